"""What `setup` ships to the workers: a `git archive` of one commit, and the TPU requirements
read from `pyproject.toml` (the `[tpu]` extra), so the pins live in one place only.

The archive holds the committed tree of `ref` (default HEAD): uncommitted edits are not
shipped, and the commit id in the archive's name says exactly what the workers run.
"""
from __future__ import annotations

import os
import subprocess
import tomllib

from tpu_scripts.quoting import clip

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(REPO, "pyproject.toml")
TPU_EXTRA = "tpu"


def tpu_requirements(pyproject: str = PYPROJECT) -> list[str]:
    """The requirement strings of the `[project.optional-dependencies] tpu` extra."""
    try:
        with open(pyproject, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise ValueError(f"{pyproject}: cannot read ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{pyproject}: not valid TOML ({err})") from None
    extras = data.get("project", {}).get("optional-dependencies", {})
    reqs = extras.get(TPU_EXTRA)
    if not reqs or not all(isinstance(r, str) for r in reqs):
        raise ValueError(f"{pyproject}: [project.optional-dependencies] has no '{TPU_EXTRA}' "
                         "list of requirements; add one (e.g. tpu = [\"jax[tpu]>=0.10,<0.12\"])")
    return list(reqs)


def resolve_commit(ref: str, repo: str = REPO) -> str:
    """The full commit id of `ref` in `repo` (a read-only git query)."""
    try:
        done = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet",
                               f"{ref}^{{commit}}"], capture_output=True, text=True)
    except FileNotFoundError:
        raise ValueError("git: not found; setup ships a `git archive` of the checkout") from None
    if done.returncode != 0 or not done.stdout.strip():
        raise ValueError(f"--ref: {clip(ref, 60)} is not a commit of {repo}; give a branch, tag or "
                         "commit id (default HEAD)")
    return done.stdout.strip()


def uncommitted_changes(repo: str = REPO) -> bool:
    """True when tracked files differ from HEAD (those edits would not be shipped)."""
    done = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True)
    return done.returncode == 0 and bool(done.stdout.strip())


def archive_name(commit: str) -> str:
    return f"lwm_jax-{commit[:12]}.tar.gz"


def archive_command(commit: str, output: str, repo: str = REPO) -> list[str]:
    """`git archive` of `commit` as a gzipped tar at `output` (paths relative to the repo)."""
    return ["git", "-C", repo, "archive", "--format=tar.gz", f"--output={output}", commit]
