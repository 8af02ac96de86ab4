"""What the tpu_scripts tests share: the gcloud project and zone they run under, the v4-32
config they launch, dry runs read back as argument lists, and hand-written compiled-step files.
(A module, not this folder's conftest: a bare `import conftest` can find another folder's.)"""
from __future__ import annotations

import hashlib
import os
import shlex

from tpu_scripts.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_SH = os.path.join(REPO, "tpu_scripts", "worker.sh")
ENV = {"CLOUDSDK_CORE_PROJECT": "my-proj", "CLOUDSDK_COMPUTE_ZONE": "us-central2-b"}
WHERE = ["--project=my-proj", "--zone=us-central2-b"]
TPU_CONFIGS = {"v4-32-rwkv7-1.5b.yaml": "v4-32", "v5p-128-rwkv7-2.9b.yaml": "v5p-128"}
V4_CONFIG = os.path.join(REPO, "configs", "tpu", "v4-32-rwkv7-1.5b.yaml")
GS = "checkpoint.dir=gs://my-bucket/runs/v4/checkpoints"


def dry(capsys, *argv, environ=ENV) -> list[list[str]]:
    """Run a dry run; the printed commands as argument lists (comment lines dropped)."""
    assert main([*argv, "--dry-run"], environ=environ) == 0
    out = capsys.readouterr().out
    return [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]


def ssh_command(argv: list[str]) -> str:
    """The --command= value of a gcloud tpu-vm ssh argument list."""
    (cmd,) = [a[len("--command="):] for a in argv if a.startswith("--command=")]
    return cmd


def compiled_step(path, overrides=(GS,), topology="v4-32", payload=b"stand-in executable",
                  **target) -> str:
    """Write a compiled-step file by hand, in lwm_jax.train.saved_step's format (MAGIC line, JSON
    header line, payload) for V4_CONFIG + `overrides` on `topology`; `target` overrides the
    header's target fields. The payload is not an executable: launch never loads it."""
    from lwm_jax.train.config import load_config
    from lwm_jax.train.saved_step import MAGIC, Header, step_config

    cfg = load_config(V4_CONFIG, [*overrides, "data.path=null", "data.val_path=null"])
    header = Header(step_config(cfg), {"platform": "tpu", "device_kind": "TPU v4", "devices": 16,
                                       "slices": 1, **target}, topology,
                    {"jax": "0.0", "jaxlib": "0.0", "libtpu": "0.0"}, "0" * 64,
                    hashlib.sha256(payload).hexdigest())
    path.write_bytes(MAGIC + header.to_json() + payload)
    return str(path)
