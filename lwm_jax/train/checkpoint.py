"""Checkpoints of a training run (orbax `CheckpointManager`).

A checkpoint `<dir>/<step>/` holds two items:
  `state`: the whole `TrainState` pytree (params in their own dtype, float32 Adam moments, step,
           loss-scale state, RNG key), written by orbax as a sharded array store;
  `data`:  the data sampler's `state_dict()` (JSON), so a resumed run reads the next batch.

Orbax writes each checkpoint into a temporary directory and renames it into place only once
every file is on disk, and `latest_step()` never returns a temporary directory, so a run killed
mid-save (even by SIGKILL) resumes from the newest COMPLETE checkpoint. Saves are asynchronous
when `checkpoint.async` is true (the step loop continues while a background thread writes);
`wait()` blocks until the last save is durable.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from lwm_jax.diagnostics.nonfinite import nonfinite_params
from lwm_jax.loss_scale import all_finite
from lwm_jax.train.config import CheckpointSection


class Checkpointer:
    """Save / restore `(TrainState, sampler state)` pairs under one directory.

    Args:
      directory: where step directories live (created if missing).
      cfg: the `checkpoint` config section (keep-last-N, async).
    """

    def __init__(self, directory: str, cfg: CheckpointSection):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_,
            cleanup_tmp_directories=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """Step of the newest complete checkpoint, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        """Start saving `state` (a pytree of jax arrays) and `data_state` (JSON-able) at `step`.

        Returns False when a checkpoint for `step` already exists (nothing written). A state
        whose parameters hold a NaN/inf is never written (ValueError naming the parameters):
        resuming from it could only reproduce the divergence.
        """
        if step in self._manager.all_steps():
            return False
        params = getattr(state, "params", state)
        if not bool(all_finite(params)):
            names = nonfinite_params(params)
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ValueError(f"checkpoint: refusing to save step {step} in {self.directory}: "
                             f"non-finite parameters ({shown}); the run diverged")
        return self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          data=ocp.args.JsonSave(data_state)), force=force)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore checkpoint `step` into the structure/dtypes/shardings of `abstract_state`.

        `abstract_state`: pytree of `jax.ShapeDtypeStruct` with `.sharding` set (see
        `abstract_with_shardings`); arrays come back placed on those shardings.
        """
        out = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                          data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def wait(self) -> None:
        """Block until every pending asynchronous save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """Pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` for restoring."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
