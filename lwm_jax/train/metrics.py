"""Training metrics: `metrics.jsonl` (always), TensorBoard (when installed), a tqdm bar, and a
loss-curve PNG at the end.

Throughput accounting (MaxText-style): `tokens_per_s` is measured over the steps since the
previous record (wall clock, data loading included). Model FLOPs per token are `6 * n_params`
(forward + backward of the matmuls; the WKV recurrence and attention-free mixing are not
counted), so `tflops = 6 * n_params * tokens_per_s / 1e12` summed over all devices, and
`mfu = tflops * 1e12 / (peak_flops_per_device * n_devices)`; `mfu` is null on devices with no
entry in `PEAK_FLOPS` (CPUs).

Record formats (one strict-JSON object per line; non-finite numbers are written as null):
  train: {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "elapsed_s",
          "skipped_steps" (steps so far whose update was skipped: non-finite loss or gradient)
          [, "loss_scale" with fp16 loss scaling]}
  eval:  {"step", "val_loss"}
`step` counts optimizer steps completed (the first record after one step has step 1).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax

# Dense bf16 peak FLOP/s per chip, matched by substring of `device.device_kind` (lower case).
PEAK_FLOPS: dict[str, float] = {
    "h100": 989e12,
    "h200": 989e12,
    "v5 lite": 197e12,
    "v5e": 197e12,
    "v5p": 459e12,
}


def peak_flops_per_device(device: Any | None = None) -> float | None:
    """Peak FLOP/s of one device from `PEAK_FLOPS`, or None when unknown (CPU)."""
    device = jax.devices()[0] if device is None else device
    if device.platform == "cpu":
        return None
    kind = device.device_kind.lower()
    for key, flops in PEAK_FLOPS.items():
        if key in kind:
            return flops
    return None


class _TensorBoard:
    """Scalar writer over tensorboardX, or over the `tensorboard` package's event writer."""

    def __init__(self, logdir: str):
        self._tbx = self._raw = None
        try:
            from tensorboardX import SummaryWriter
            self._tbx = SummaryWriter(logdir)
            return
        except ImportError:
            pass
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self._raw, self._event_pb2, self._summary_pb2 = EventFileWriter(logdir), event_pb2, \
            summary_pb2

    @staticmethod
    def available() -> bool:
        for mod in ("tensorboardX", "tensorboard"):
            try:
                __import__(mod)
                return True
            except ImportError:
                continue
        return False

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self._tbx is not None:
            self._tbx.add_scalar(tag, value, step)
            return
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=value)])
        self._raw.add_event(self._event_pb2.Event(wall_time=time.time(), step=step,
                                                  summary=summary))

    def close(self) -> None:
        (self._tbx or self._raw).close()


class MetricsLogger:
    """Writes train/eval records and drives the progress bar.

    Args:
      run_dir: directory for `metrics.jsonl`, `tb/` and `loss_curve.png`.
      n_params: parameter count (for FLOP/s).
      tokens_per_step: batch_size * ctx_len (global).
      total_steps / start_step: for the progress bar (start_step > 0 on resume).
      progress: show a tqdm bar (stderr).
      fp16: include loss-scale fields.
      write: False on the processes of a multi-process run other than process 0: nothing is
        written or shown (records, TensorBoard, bar, eval lines), so each record exists once.
    """

    def __init__(self, run_dir: str, *, n_params: int, tokens_per_step: int, total_steps: int,
                 start_step: int = 0, progress: bool = True, fp16: bool = False,
                 write: bool = True):
        from tqdm.auto import tqdm
        self.run_dir, self._echo = run_dir, write
        self.path = os.path.join(run_dir, "metrics.jsonl") if write else os.devnull
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = (_TensorBoard(os.path.join(run_dir, "tb"))
                    if write and _TensorBoard.available() else None)
        self.n_params, self.tokens_per_step, self.fp16 = n_params, tokens_per_step, fp16
        self.n_devices = jax.device_count()
        self.peak = peak_flops_per_device()
        self._bar = tqdm(total=total_steps, initial=start_step, disable=not (progress and write),
                         unit="step", dynamic_ncols=True)
        self._t0 = time.perf_counter()
        self._mark_time, self._mark_step = self._t0, start_step

    def reset_timer(self, step: int) -> None:
        """Start throughput timing at `step` (call after the first, compiling, step)."""
        self._mark_time, self._mark_step = time.perf_counter(), step

    def advance(self, n: int = 1) -> None:
        self._bar.update(n)

    def log_train(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record step `step` (`metrics` may hold device scalars; they are fetched here)."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        steps = step - self._mark_step
        tok_s = steps * self.tokens_per_step / (now - self._mark_time) if steps > 0 else None
        self._mark_time, self._mark_step = now, step
        tflops = 6 * self.n_params * tok_s / 1e12 if tok_s else None
        mfu = (tflops * 1e12 / (self.peak * self.n_devices)
               if tflops is not None and self.peak else None)
        rec = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
               "tokens_per_s": tok_s, "tflops": tflops, "mfu": mfu,
               "elapsed_s": now - self._t0, "skipped_steps": int(m["skipped_steps"])}
        if self.fp16:
            rec.update(loss_scale=m["loss_scale"])
        self._write(rec)
        post = {"loss": f"{m['loss']:.4f}"}
        if tok_s:
            post["tok/s"] = f"{tok_s:,.0f}"
        self._bar.set_postfix(post, refresh=False)
        return rec

    def log_eval(self, step: int, val_loss: float) -> None:
        self._write({"step": step, "val_loss": float(val_loss)})
        if self._echo:
            self._bar.write(f"step {step}: val_loss {float(val_loss):.4f}")

    def _write(self, rec: dict[str, Any]) -> None:
        # Strict JSON: a non-finite number (fp16 overflow, divergence) is written as null.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in rec.items()}
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k != "step" and v is not None and math.isfinite(v):
                    self._tb.scalar(k if k == "val_loss" else f"train/{k}", v, rec["step"])

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from a metrics.jsonl (later records win on resumed runs)."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                (evals if "val_loss" in rec else train)[rec["step"]] = rec
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def plot_loss_curve(metrics_path: str, png_path: str, title: str = "") -> str:
    """Train loss vs step (and validation loss points) from metrics.jsonl -> PNG; returns path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-",
                label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
