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

A save that fails for lack of space (at once, or later in the background thread, which then
surfaces in the next `save`/`wait`) raises `CheckpointWriteError`: one line naming the
directory and the newest complete checkpoint, the one a rerun resumes from. Orbax's unfinished
`<step>.orbax-checkpoint-tmp` directory stays behind and is removed by the next save of that
step, so freeing space and running the same command again resumes.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from lwm_jax.diagnostics.nonfinite import nonfinite_params
from lwm_jax.loss_scale import all_finite
from lwm_jax.train.config import CheckpointSection


_NO_SPACE = ("No space left on device", "os_error_code='28'", "Disk quota exceeded",
             "os_error_code='122'")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full or quota exceeded). `exit_status` 2: the
    CLI prints the message as its one line."""
    exit_status = 2

    def __str__(self) -> str:
        return str(self.strerror)


class _DropFullDiskTracebacks(logging.Filter):
    """Orbax logs a failed background write with full tracebacks (several records) before the
    error reaches the caller, which reports it in one line (`CheckpointWriteError`): drop those
    records, and only those (a full disk, or the writer thread's failure notice)."""

    def filter(self, record: logging.LogRecord) -> bool:
        texts = [str(record.msg)]
        if record.exc_info and record.exc_info[1] is not None:
            texts.append(str(record.exc_info[1]))
        if "_SignalingThread.run() raised an exception" in texts[0]:
            return False
        return not any(s in t for t in texts for s in _NO_SPACE)


logging.getLogger("absl").addFilter(_DropFullDiskTracebacks())


def checkpoint_location(directory: str) -> str:
    """Where orbax writes: a local path made absolute, or a URL (`gs://bucket/path`, which orbax
    and tensorstore write directly; `os.path.abspath` would turn it into the local directory
    `<cwd>/gs:/bucket/path`) unchanged."""
    return directory if "://" in directory else os.path.abspath(directory)


class Checkpointer:
    """Save / restore `(TrainState, sampler state)` pairs under one directory.

    Args:
      directory: where step directories live (created if missing).
      cfg: the `checkpoint` config section (keep-last-N, async).
    """

    def __init__(self, directory: str, cfg: CheckpointSection):
        self.directory = checkpoint_location(directory)
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
        with self._reporting_full_disk():   # an async save reports the previous one
            return self._manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                              data=ocp.args.JsonSave(data_state)), force=force)

    @contextlib.contextmanager
    def _reporting_full_disk(self):
        """Turn a full-disk failure inside the block into a `CheckpointWriteError`."""
        try:
            yield
        except CheckpointWriteError:
            raise
        except Exception as err:
            text = str(err)
            full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
                    or any(s in text for s in _NO_SPACE))
            if not full:
                raise
            try:
                latest = self._manager.latest_step()
            except Exception:
                latest = None
            lost = (f"no checkpoint after step {latest} was written" if latest is not None
                    else "no checkpoint was written")
            raise CheckpointWriteError(
                errno.ENOSPC, f"checkpoint: no space left on device in {self.directory} "
                f"({lost}); free some space or set checkpoint.dir to a larger "
                "disk, then run the same command again to resume") from None

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
        with self._reporting_full_disk():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """Pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` for restoring."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)
