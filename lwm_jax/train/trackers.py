"""Experiment trackers: where training records go (the `logging.trackers` config key).

| name          | writes                                                   | needs          |
|---------------|----------------------------------------------------------|----------------|
| `jsonl`       | `<run_dir>/metrics.jsonl`, one strict-JSON object a line | nothing        |
| `tensorboard` | `<run_dir>/tb/events.out.tfevents.*`                     | `tensorboardX` |
| `wandb`       | a Weights & Biases run (files under `<run_dir>/wandb/`)  | `wandb`        |

(`WANDB_MODE=offline` keeps the W&B run on disk, no network.)

Every tracker answers three calls, all with plain Python values:
  * `log_config(step, config)`: the resolved run config (a nested dict), once per `train` call
    (a resumed run records the config it resumed with, at the step it resumed from);
  * `log_scalars(step, scalars, kind)`: `kind` "train" or "eval"; a value may be None (not
    measured, or non-finite), which the JSONL file writes as null and the others leave out;
  * `close()`.
Tags in TensorBoard and W&B: `train/<name>` for train records, `val_loss` for evaluations,
`config` (a YAML text) for the config. The W&B run id is kept in `<run_dir>/wandb/run_id`, so a
resumed run appends to the same W&B run.

Only process 0 of a multi-process run builds trackers (`MetricsLogger(write=False)` elsewhere).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
from typing import Any, Protocol, Sequence

import yaml

TRACKERS = ("jsonl", "tensorboard", "wandb")
JSONL_NAME = "metrics.jsonl"
TB_DIR = "tb"
WANDB_DIR = "wandb"


class Tracker(Protocol):
    """One destination of training records (see the module docstring)."""

    name: str

    def log_config(self, step: int, config: dict[str, Any]) -> None: ...

    def log_scalars(self, step: int, scalars: dict[str, float | None], kind: str) -> None: ...

    def close(self) -> None: ...


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _tag(name: str, kind: str) -> str:
    return name if kind == "eval" else f"train/{name}"


class JsonlTracker:
    """`metrics.jsonl`: `{"step", ...scalars}` per record, `{"step", "config"}` per config.
    Non-finite numbers are written as null (strict JSON); each line is flushed."""

    name = "jsonl"

    def __init__(self, run_dir: str):
        from lwm_jax.train.run_lock import open_no_follow
        self.path = os.path.join(run_dir, JSONL_NAME)
        fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        # A writer killed mid-line leaves a torn last line: start the next record on a line
        # of its own, so only that line is damaged (`metrics.read_metrics` skips it).
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def log_config(self, step: int, config: dict[str, Any]) -> None:
        self._line({"step": step, "config": config})

    def log_scalars(self, step: int, scalars: dict[str, float | None], kind: str) -> None:
        clean = {k: (v if v is None or _finite(v) else None) for k, v in scalars.items()}
        self._line({"step": step, **clean})

    def _line(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker:
    """TensorBoard event files through tensorboardX's `SummaryWriter` (scalars and the config
    as a text summary)."""

    name = "tensorboard"

    def __init__(self, run_dir: str):
        from tensorboardX import SummaryWriter
        self._writer = SummaryWriter(os.path.join(run_dir, TB_DIR))

    def log_config(self, step: int, config: dict[str, Any]) -> None:
        text = yaml.safe_dump(config, sort_keys=False)
        # TensorBoard renders text as Markdown: indent four spaces for a code block
        self._writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()),
                              step)
        self._writer.flush()

    def log_scalars(self, step: int, scalars: dict[str, float | None], kind: str) -> None:
        for name, value in scalars.items():
            if _finite(value):
                self._writer.add_scalar(_tag(name, kind), value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run named after the run (`name`), in `project` / `entity`, with its
    files under `<run_dir>/wandb/`. W&B's console capture is off (the trainer's progress bar
    and one-line errors stay as they are). `WANDB_MODE=offline` runs it without a network;
    `wandb sync <run_dir>/wandb/offline-run-*` uploads later."""

    name = "wandb"

    def __init__(self, run_dir: str, *, name: str, project: str, entity: str | None):
        import wandb

        os.makedirs(os.path.join(run_dir, WANDB_DIR), exist_ok=True)
        id_path = os.path.join(run_dir, WANDB_DIR, "run_id")
        run_id = None
        if os.path.isfile(id_path):
            with open(id_path, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        run_id = run_id or secrets.token_hex(6)         # W&B ids: lower-case letters, digits
        try:
            self._run = wandb.init(project=project, entity=entity, name=name, dir=run_dir,
                                   id=run_id, resume="allow",
                                   settings=wandb.Settings(console="off"))
        except Exception as err:         # wandb raises its own classes (no API key, network)
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            raise ValueError(f"logging.trackers: wandb could not start a run "
                             f"({type(err).__name__}: {first}); run `wandb login`, set "
                             "WANDB_MODE=offline, or remove wandb from logging.trackers") \
                from None
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")

    def log_config(self, step: int, config: dict[str, Any]) -> None:
        self._run.config.update(config, allow_val_change=True)

    def log_scalars(self, step: int, scalars: dict[str, float | None], kind: str) -> None:
        values = {_tag(k, kind): v for k, v in scalars.items() if _finite(v)}
        if values:
            self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_trackers(names: Sequence[str]) -> list[str]:
    """Messages (one line each) for requested trackers that cannot run and are skipped:
    `tensorboard` without tensorboardX. Raises ValueError (one line) for `wandb` without the
    `wandb` package: a tracker asked for by name is not dropped silently."""
    notes = []
    if "tensorboard" in names and not _installed("tensorboardX"):
        notes.append("logging.trackers has tensorboard but tensorboardX is not installed, so no "
                     "TensorBoard events are written (pip install tensorboardX, or remove "
                     "tensorboard from logging.trackers)")
    if "wandb" in names and not _installed("wandb"):
        raise ValueError("logging.trackers: wandb is not installed; pip install "
                         "'lwm_jax[trackers]' (or wandb), or remove wandb from logging.trackers")
    return notes


def make_trackers(names: Sequence[str], run_dir: str, *, run_name: str = "run",
                  wandb_project: str = "lwm-jax",
                  wandb_entity: str | None = None) -> list[Tracker]:
    """The trackers `names` asks for, in that order (tensorboard is left out when tensorboardX
    is missing: `check_trackers` says so). Raises ValueError as `check_trackers` does."""
    check_trackers(names)
    out: list[Tracker] = []
    try:
        for name in names:
            if name == "jsonl":
                out.append(JsonlTracker(run_dir))
            elif name == "tensorboard":
                if _installed("tensorboardX"):
                    out.append(TensorBoardTracker(run_dir))
            elif name == "wandb":
                out.append(WandbTracker(run_dir, name=run_name, project=wandb_project,
                                        entity=wandb_entity))
            else:
                raise ValueError(f"logging.trackers: {name!r} is not one of "
                                 f"{', '.join(TRACKERS)}")
    except BaseException:
        for tracker in out:
            tracker.close()
        raise
    return out
