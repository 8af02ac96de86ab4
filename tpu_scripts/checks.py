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
  with empty disks, so only a `gs://` checkpoint survives a preemption).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from tpu_scripts.slices import Slice


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """Where the run writes: `run_dir` (on worker 0) and `checkpoint_dir`."""

    name: str
    run_dir: str
    checkpoint_dir: str


def check_launch(config_path: str, overrides: Sequence[str], slice_: Slice | None, *,
                 survive_preemption: bool = False) -> RunInfo:
    """Validate `config_path` + `overrides` for a launch on `slice_` (None: unknown slice)."""
    from lwm_jax.train.config import check_against_mesh, load_config, mesh_shape

    cfg = load_config(config_path, [*overrides, "data.path=null", "data.val_path=null"])
    if "://" in cfg.resolved_run_dir:
        raise ValueError(f"run_dir: {cfg.resolved_run_dir!r:.100} is a URL, but lwm-jax train "
                         "writes the run dir with local file calls; leave run_dir local (worker "
                         "0 keeps it) and set checkpoint.dir=gs://BUCKET/... instead")
    ckpt = cfg.checkpoint_dir
    remote = ckpt.startswith("gs://")
    if "://" in ckpt and not remote:
        raise ValueError(f"checkpoint.dir: {ckpt!r:.100}: only gs:// URLs are supported on "
                         "Cloud TPU")
    if slice_ is not None:
        sizes = mesh_shape(cfg.mesh, slice_.chips)
        check_against_mesh(cfg, sizes)
        if slice_.multi_host and not remote:
            raise ValueError(f"checkpoint.dir: {ckpt!r:.100} is local, but {slice_.accelerator_type} "
                             f"has {slice_.hosts} hosts and every host writes its own shards; "
                             "set checkpoint.dir=gs://BUCKET/PATH (a bucket every worker can "
                             "write)")
    if survive_preemption and not remote:
        raise ValueError(f"checkpoint.dir: {ckpt!r:.100} is local, but babysit recreates a "
                         "preempted TPU with empty disks, so training could never resume; set "
                         "checkpoint.dir=gs://BUCKET/PATH")
    return RunInfo(cfg.name, cfg.resolved_run_dir, ckpt)
