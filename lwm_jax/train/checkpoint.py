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

Damaged checkpoints. A checkpoint's metadata files can be truncated or overwritten after it was
written (a disk or copy fault, a hand edit; `lwm_jax.interop.orbax_files.step_damage` lists the
files and what each must hold). Orbax reports such a file with a traceback from inside its
parser, or, for a step's `_CHECKPOINT_METADATA`, logs an error and goes on, so `Checkpointer`
checks the newest checkpoints when it opens the directory, before orbax sees them:
  - the newest intact one is what a resume starts from. Each damaged one newer than it is moved
    aside to `<step>.damaged` (never deleted: it may still be worth repairing) with a warning
    naming it, its damaged file and the step resumed from. Never silently: a run that quietly
    resumed from an older step would redo steps the user believes were done. Moving it aside is
    needed, not only skipping it: orbax refuses to save at or below its newest step, so a
    damaged step left in place would stop every later checkpoint up to it from being written;
  - when no intact checkpoint is left, nothing is moved and the error is one line: starting the
    run afresh over damaged checkpoints is for the user to choose (remove them);
  - a multi-process run moves nothing (the other processes may be reading the directory): a
    damaged step is a one-line error naming it and the newest intact step.
A damaged array chunk, which the metadata cannot show, is found by the restore itself; the
restore then falls back the same way (`Checkpointer.restore`). A remote `checkpoint.dir`
(gs://) is not inspected and nothing there is moved; a restore that fails there is one line
naming the step directory and the previous checkpoint.

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
import re
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

from lwm_jax.diagnostics.nonfinite import nonfinite_params
from lwm_jax.interop.orbax_files import corrupt_data, restore_detail, step_damage
from lwm_jax.precision.loss_scale import all_finite
from lwm_jax.train.config import CheckpointSection


# One compiled check per parameter tree (cached across saves): run op by op it compiled a
# reduction per parameter shape at the first save (~1.2 s for the tiny config on a CPU, 0.46 s
# compiled whole).
_params_finite = jax.jit(all_finite)

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
        self.moved_aside: dict[int, str] = {}   # damaged step -> where it was moved
        self._set_aside_damaged()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=True, enable_async_checkpointing=cfg.async_,
            cleanup_tmp_directories=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def _step_dirs(self) -> list[int]:
        """Steps with a directory here, newest first (orbax's temporary directories and steps
        moved aside are not numbers)."""
        if "://" in self.directory or not os.path.isdir(self.directory):
            return []
        return sorted((int(name) for name in os.listdir(self.directory)
                       if re.fullmatch("[0-9]+", name) and os.path.isdir(os.path.join(self.directory, name))),
                      reverse=True)

    def _may_move(self) -> bool:
        """Whether damaged steps may be moved aside here (see the module docstring)."""
        return "://" not in self.directory and jax.process_count() == 1

    def _move_aside(self, step: int, problem: str, resume_from: int, stacklevel: int) -> None:
        """Rename damaged step `step` to `<step>.damaged` (`-2`, `-3`, ... when taken) and warn
        (the warning points at the code that opened or restored the checkpoints)."""
        source = os.path.join(self.directory, str(step))
        target, n = source + ".damaged", 1
        while os.path.lexists(target):
            n += 1
            target = f"{source}.damaged-{n}"
        os.rename(source, target)
        self.moved_aside[step] = target
        warnings.warn(
            f"checkpoint: step {step} in {self.directory} is damaged ({problem}); moved it to "
            f"{target} and resuming from step {resume_from}, the newest intact checkpoint "
            "(delete the moved directory once it is not needed)", RuntimeWarning,
            stacklevel=stacklevel)

    def _set_aside_damaged(self) -> None:
        """Move the damaged checkpoints newer than the newest intact one aside (see the module
        docstring); ValueError (one line) where that is not done."""
        damaged: list[tuple[int, str]] = []
        intact = None
        for step in self._step_dirs():
            problem = step_damage(os.path.join(self.directory, str(step)))
            if problem is None:
                intact = step
                break
            damaged.append((step, problem))
        if not damaged:
            return
        newest, problem = damaged[0]
        if intact is None:
            raise ValueError(
                f"checkpoint: every checkpoint in {self.directory} is damaged (step {newest}: "
                f"{problem}); remove or restore them (with none left the run starts afresh), "
                "or choose a new run_dir")
        if not self._may_move():
            raise ValueError(
                f"checkpoint: step {newest} in {self.directory} is damaged ({problem}); remove "
                f"or restore {os.path.join(self.directory, str(newest))} and run the same "
                f"command again to resume from step {intact}, the newest intact checkpoint")
        for step, problem in damaged:
            self._move_aside(step, problem, intact, stacklevel=4)    # Checkpointer()'s caller

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
        if not bool(_params_finite(params)):
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

        When `step` proves damaged while it is read (an array chunk tensorstore cannot decode
        or finds short, which the metadata checks cannot see), a single-process run moves it
        aside with a warning, as a damaged metadata file is, and restores the next older
        checkpoint instead: the returned state's own `step` says which one. Any other failure
        (memory aside), and damage where nothing may be moved or nothing older exists, is a
        one-line ValueError naming the step directory and the previous checkpoint.
        """
        while True:
            try:
                out = self._manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                  data=ocp.args.JsonRestore()))
                return out["state"], out["data"]
            except Exception as err:
                if isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in str(err):
                    raise
                step_dir = os.path.join(self.directory, str(step))
                older = [s for s in self.all_steps() if s < step]
                problem = step_damage(step_dir) or corrupt_data(err)
                if problem is not None and older and self._may_move():
                    self._move_aside(step, problem, older[-1], stacklevel=3)   # restore's caller
                    self._manager.reload()          # orbax forgets the step moved away
                    step = older[-1]
                    continue
                then = (f"it then resumes from step {older[-1]}" if older
                        else "with no older checkpoint it then starts afresh")
                what = (f"is damaged ({problem}); " if problem is not None
                        else f"cannot be restored ({restore_detail(err)}); if it is damaged, ")
                raise ValueError(f"checkpoint: step {step} in {step_dir} {what}remove it or "
                                 "restore it from a copy and run the same command again "
                                 f"({then})") from None

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
