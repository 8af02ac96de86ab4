"""Check a run config on the workstation before any TPU time is spent on it.

`check_launch` loads the config exactly as `lwm-jax train` will on the workers (same file,
same overrides; the data paths, which exist only on the workers, are left out of this check)
and refuses, each with one line:

- anything `lwm_jax.train.config.load_config` refuses (unknown key, wrong type, ...);
- a `run_dir` that is a URL: `lwm-jax train` writes `config.yaml`, `metrics.jsonl` and its
  lock file there with local file calls, so `run_dir=gs://...` would silently become a local
  directory named `gs:`. The run dir stays on worker 0's disk; checkpoints go to GCS;
- a mesh whose axis sizes do not multiply to the slice's chip count, or a batch the mesh
  cannot split (`mesh_shape`, `check_against_mesh`), when the accelerator type is known;
- a local checkpoint directory on a multi-host slice (each host would write its own shards on
  its own disk: no host holds a whole checkpoint), or under `babysit` (a recreated TPU starts
  with empty disks, so only a `gs://` checkpoint survives a preemption);
- with `--compiled PATH` (`check_compiled`): a PATH that is missing or not a compiled step
  (`lwm_jax.train.saved_step.read_header`), one compiled for another platform than TPU or, when the
  accelerator type is known, for another generation, chip count or slice count, or for another
  config than this launch's (`step_config`, the rule `lwm-jax train --compiled` applies). Each
  message ends with the `lwm-jax compile ... --save PATH` command that makes a fitting file.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Sequence

from tpu_scripts.quoting import clip
from tpu_scripts.slices import Slice


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """Where the run writes: `run_dir` (on worker 0) and `checkpoint_dir`."""

    name: str
    run_dir: str
    checkpoint_dir: str


def check_launch(config_path: str, overrides: Sequence[str], slice_: Slice | None, *,
                 survive_preemption: bool = False, compiled: str | None = None) -> RunInfo:
    """Validate `config_path` + `overrides` (and the compiled step `compiled`, if any) for a
    launch on `slice_` (None: unknown slice)."""
    from lwm_jax.train.config import check_against_mesh, load_config, mesh_shape

    cfg = load_config(config_path, [*overrides, "data.path=null", "data.val_path=null"])
    if "://" in cfg.resolved_run_dir:
        raise ValueError(f"run_dir: {clip(cfg.resolved_run_dir, 100)} is a URL, but lwm-jax train "
                         "writes the run dir with local file calls; leave run_dir local (worker "
                         "0 keeps it) and set checkpoint.dir=gs://BUCKET/... instead")
    ckpt = cfg.checkpoint_dir
    remote = ckpt.startswith("gs://")
    if "://" in ckpt and not remote:
        raise ValueError(f"checkpoint.dir: {clip(ckpt, 100)}: only gs:// URLs are supported on "
                         "Cloud TPU")
    if slice_ is not None:
        sizes = mesh_shape(cfg.mesh, slice_.chips)
        check_against_mesh(cfg, sizes)
        if slice_.multi_host and not remote:
            raise ValueError(f"checkpoint.dir: {clip(ckpt, 100)} is local, but {slice_.accelerator_type} "
                             f"has {slice_.hosts} hosts and every host writes its own shards; "
                             "set checkpoint.dir=gs://BUCKET/PATH (a bucket every worker can "
                             "write)")
    if survive_preemption and not remote:
        raise ValueError(f"checkpoint.dir: {clip(ckpt, 100)} is local, but babysit recreates a "
                         "preempted TPU with empty disks, so training could never resume; set "
                         "checkpoint.dir=gs://BUCKET/PATH")
    if compiled is not None:
        check_compiled(compiled, cfg, slice_, config_path, overrides)
    return RunInfo(cfg.name, cfg.resolved_run_dir, ckpt)


def check_compiled(path: str, cfg, slice_: Slice | None, config_path: str,
                   overrides: Sequence[str]) -> None:
    """Refuse (one line) a compiled step that `lwm-jax train --compiled` on `slice_` would
    refuse for its file, target or config (`cfg`: the launch's loaded config). The jax / jaxlib
    / libtpu versions are the workers' and are checked there."""
    from lwm_jax.train.saved_step import config_mismatch, read_header

    topology = slice_.accelerator_type if slice_ is not None else "TYPE"
    make = compile_command(config_path, overrides, topology, path)
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise ValueError(f"--compiled: {path} is not a regular file (a FIFO, device or socket); "
                         f"write the compiled step to a file with `{make}`")
    if not os.path.isfile(path):
        raise ValueError(f"--compiled: {path} not found; write it with `{make}`")
    try:
        header, _ = read_header(path)
    except ValueError as err:
        raise ValueError(f"{err}: `{make}`") from None
    if slice_ is None and header.target.get("platform") == "tpu":
        make = compile_command(config_path, overrides, header.topology, path)
    mismatch = _target_mismatch(header, slice_)
    if mismatch is not None:
        key, have, want, what = mismatch
        raise ValueError(f"--compiled: {path} was compiled for {header.topology} ({key} "
                         f"{have!r}) but {what} has {key} {want!r}; run `{make}` again")
    mismatch = config_mismatch(header, path, cfg)
    if mismatch is not None:
        raise ValueError(f"{mismatch}: `{make}`")


def _target_mismatch(header, slice_: Slice | None) -> tuple[str, object, object, str] | None:
    """The first (key, the header's value, the launch's, whose) that differ: the platform, and
    with a known slice its generation, chip count and slice count (1: launch is one slice)."""
    checks = [("platform", header.target.get("platform"), "tpu", "Cloud TPU")]
    if slice_ is not None:
        name = slice_.accelerator_type
        generation = _header_generation(header)
        if generation is not None:
            checks.append(("generation", generation, slice_.generation, name))
        checks += [("devices", header.target.get("devices"), slice_.chips, name),
                   ("slices", header.target.get("slices"), 1, name)]
    return next((c for c in checks if c[1] != c[2]), None)


def _header_generation(header) -> str | None:
    """The Cloud TPU generation of the header's topology name (None when it names none)."""
    from lwm_jax.aot.topology import parse_topology
    try:
        return parse_topology(header.topology).generation
    except ValueError:
        return None


def compile_command(config_path: str, overrides: Sequence[str], topology: str,
                    path: str) -> str:
    """The `lwm-jax compile` command line (shell-quoted) that writes a fitting `path`."""
    return shlex.join(["lwm-jax", "compile", "--config", config_path, *overrides,
                       "--topology", topology, "--save", path])
