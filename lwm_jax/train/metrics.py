"""Training metrics: the records every tracker gets (`lwm_jax.train.trackers`: metrics.jsonl,
TensorBoard, Weights & Biases), a tqdm bar, and a loss-curve PNG at the end.

Throughput accounting: `tokens_per_s` is measured over the steps since the previous record
(wall clock, data loading included). Two FLOP counts, both summed over all devices:
- `tflops` / `mfu`: 6 x all parameters, `tflops = 6 * n_params * tokens_per_s / 1e12` (the
  embedding table included; the WKV recurrence and attention scores not counted), kept as
  this project always reported it;
- `model_tflops` / `model_mfu`: the field's convention (MaxText, RWKV-LM, PaLM appendix B),
  `model_flops_per_token * tokens_per_s / 1e12` with `model_flops_per_token` from
  `lwm_jax.models.flops`: 6 x the parameters other than the input embedding (the LM head
  counted once, tied or not) plus 3 x the sequence mixer's own forward FLOPs (causal attention
  `2 * T * n_heads * d_head`, RWKV-7's WKV `9 * C * head_size`, per token and layer).
`mfu = tflops * 1e12 / (peak_flops_per_device * n_devices)` and likewise `model_mfu`; both are
null on devices with no entry in `lwm_jax.hardware.CHIPS` (CPUs), and `model_*` are null when
the logger was given no `model_flops_per_token`.

Record formats (metrics.jsonl: one strict-JSON object per line; non-finite numbers are null):
  train:  {"step", "loss" (this step's), "loss_mean" (mean of the finite losses of the steps
           since the previous train record), "lr", "grad_norm", "tokens_per_s", "tflops", "mfu"
           (6 x all parameters), "model_tflops", "model_mfu" (the convention above),
           "elapsed_s", "skipped_steps" (steps so far whose update was skipped: non-finite loss
           or gradient) [, "loss_scale" with fp16 loss scaling]}
  eval:   {"step", "val_loss"}
  config: {"step", "config"} the resolved run config, once per `train` call
`step` counts optimizer steps completed (the first record after one step has step 1).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from lwm_jax.hardware import peak_flops_per_device
from lwm_jax.train.trackers import JsonlTracker, Tracker, make_trackers

def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):      # replaced or closed stream
        return False


@jax.jit
def _accumulate(acc, loss, finite):
    """(sum, count) of finite losses, plus this step's loss when `finite` > 0 (float32)."""
    ok = jnp.asarray(finite) > 0
    return (acc[0] + jnp.where(ok, jnp.asarray(loss, jnp.float32), 0.0),
            acc[1] + ok.astype(jnp.float32))


def _local(x: Any) -> Any:
    """One addressable copy of a replicated scalar: arithmetic on it runs on this process's
    device only, so process 0 may do it alone in a multi-process run."""
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


class MetricsLogger:
    """Writes train/eval records to the trackers and drives the progress bar.

    Args:
      run_dir: the run directory (trackers write under it; `loss_curve.png` too).
      n_params: parameter count, all of them (for `tflops` / `mfu`: 6 x n_params per token).
      model_flops_per_token: model FLOPs per trained token by the field's convention
        (`lwm_jax.models.registry.Arch.model_flops_per_token`), for `model_tflops` /
        `model_mfu`; None leaves those null.
      tokens_per_step: batch_size * ctx_len (global).
      total_steps / start_step: for the progress bar (start_step > 0 on resume).
      progress: show a tqdm bar (stderr).
      fp16: include loss-scale fields.
      write: False on the processes of a multi-process run other than process 0: nothing is
        written or shown (records, trackers, bar, eval lines), so each record exists once.
      trackers: the `lwm_jax.train.trackers` objects to write to; None = `metrics.jsonl` and,
        when tensorboardX is installed, TensorBoard. Closed by `close()`.
    """

    def __init__(self, run_dir: str, *, n_params: int, tokens_per_step: int, total_steps: int,
                 start_step: int = 0, progress: bool = True, fp16: bool = False,
                 write: bool = True, trackers: Sequence[Tracker] | None = None,
                 model_flops_per_token: float | None = None):
        from tqdm.auto import tqdm
        self.run_dir, self._echo = run_dir, write
        if trackers is None and write:
            trackers = make_trackers(["jsonl", "tensorboard"], run_dir)
        self._trackers = list(trackers or []) if write else []
        jsonl = [t for t in self._trackers if isinstance(t, JsonlTracker)]
        self.path = jsonl[0].path if jsonl else None     # metrics.jsonl, or None without one
        self.n_params, self.tokens_per_step, self.fp16 = n_params, tokens_per_step, fp16
        self.model_flops_per_token = model_flops_per_token
        self.n_devices = jax.device_count()
        self.peak = peak_flops_per_device()
        # A bar redraws one line with carriage returns: on a terminal. Anywhere else (nohup,
        # sbatch, a log file) and with progress=False, each train record is one plain line.
        self._bar_on = progress and write and _stderr_is_terminal()
        self._lines = write and not self._bar_on
        self._bar = tqdm(total=total_steps, initial=start_step, disable=not self._bar_on,
                         unit="step", dynamic_ncols=True)
        self._t0 = time.perf_counter()
        self._mark_time, self._mark_step = self._t0, start_step
        self._acc = None            # device (sum, count) of finite losses since the last record

    def reset_timer(self, step: int) -> None:
        """Start throughput timing at `step` (call after the first, compiling, step)."""
        self._mark_time, self._mark_step = time.perf_counter(), step

    def advance(self, n: int = 1, metrics: dict[str, Any] | None = None) -> None:
        """Move the bar by `n` steps; with one step's `metrics` (device scalars `loss`,
        `finite`), add its loss to the running mean (no device-to-host transfer)."""
        self._bar.update(n)
        if metrics is not None and self._echo:
            acc = self._acc or (jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))
            self._acc = _accumulate(acc, _local(metrics["loss"]),
                                    _local(metrics.get("finite", 1.0)))

    def log_config(self, step: int, config: dict[str, Any]) -> None:
        """The run config (a plain nested dict), to every tracker, once per `train` call."""
        for tracker in self._trackers:
            tracker.log_config(step, config)

    def log_train(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record step `step` (`metrics` may hold device scalars; they are fetched here).

        `loss_mean` is the mean of the finite losses of the steps passed to `advance` since the
        previous record (None when none were), the smoothed curve beside the raw `loss`.
        """
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        loss_mean = None
        if self._acc is not None:
            total, count = (float(v) for v in jax.device_get(self._acc))
            loss_mean = total / count if count > 0 else None
            self._acc = None
        now = time.perf_counter()
        steps = step - self._mark_step
        tok_s = steps * self.tokens_per_step / (now - self._mark_time) if steps > 0 else None
        self._mark_time, self._mark_step = now, step
        tflops = self._tflops(6 * self.n_params, tok_s)
        model_tflops = self._tflops(self.model_flops_per_token, tok_s)
        rec = {"step": step, "loss": m["loss"], "loss_mean": loss_mean, "lr": m["lr"],
               "grad_norm": m["grad_norm"], "tokens_per_s": tok_s, "tflops": tflops,
               "mfu": self._utilization(tflops), "model_tflops": model_tflops,
               "model_mfu": self._utilization(model_tflops), "elapsed_s": now - self._t0,
               "skipped_steps": int(m["skipped_steps"])}
        if self.fp16:
            rec.update(loss_scale=m["loss_scale"])
        self._write(rec, "train")
        post = {"loss": f"{m['loss']:.4f}"}
        if tok_s:
            post["tok/s"] = f"{tok_s:,.0f}"
        self._bar.set_postfix(post, refresh=False)
        if self._lines:
            rate = f", {tok_s:,.0f} tokens/s" if tok_s else ""
            use = _mfu_text(rec["mfu"], rec["model_mfu"])
            self._bar.write(f"step {step}: loss {m['loss']:.4f}, lr {m['lr']:.3g}, grad norm "
                            f"{m['grad_norm']:.3g}{rate}{use}")
        return rec

    @staticmethod
    def _tflops(flops_per_token: float | None, tok_s: float | None) -> float | None:
        """TFLOP/s (1e12 FLOP/s, all devices) of `flops_per_token` at `tok_s` tokens/s."""
        if flops_per_token is None or not tok_s:
            return None
        return flops_per_token * tok_s / 1e12

    def _utilization(self, tflops: float | None) -> float | None:
        """`tflops` as a fraction of the devices' summed peak (None when either is unknown)."""
        if tflops is None or not self.peak:
            return None
        return tflops * 1e12 / (self.peak * self.n_devices)

    def log_eval(self, step: int, val_loss: float) -> None:
        self._write({"step": step, "val_loss": float(val_loss)}, "eval")
        if self._echo:
            self._bar.write(f"step {step}: val_loss {float(val_loss):.4f}")

    def _write(self, rec: dict[str, Any], kind: str) -> None:
        scalars = {k: v for k, v in rec.items() if k != "step"}
        for tracker in self._trackers:
            tracker.log_scalars(rec["step"], scalars, kind)

    def close(self) -> None:
        self._bar.close()
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


def _mfu_text(mfu: float | None, model_mfu: float | None) -> str:
    """", MFU 28.1% (model 24.0%)" for a step line; "" with no MFU."""
    if not mfu:
        return ""
    model = f" (model {100 * model_mfu:.1f}%)" if model_mfu is not None else ""
    return f", MFU {100 * mfu:.1f}%{model}"


def _loss_ok(value: Any) -> bool:
    """A plottable loss field: a finite number, or null (a non-finite loss is written as
    null: a gap in the curve)."""
    if value is None:
        return True
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:       # an integer beyond float range
        return False


def _nan(value: Any) -> float:
    return float("nan") if value is None else float(value)


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from a metrics.jsonl (later records win on resumed runs;
    config records are skipped; a line that is not a JSON record with an integer `step` is
    skipped with one warning)."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    damaged = 0
    from lwm_jax.train.run_lock import open_no_follow
    fd = open_no_follow(path, os.O_RDONLY)      # refuses a FIFO (would block) in one line
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):     # not JSON; nested too deep
                rec = None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                damaged += 1          # a torn line left by a killed writer: skip, say so
                continue
            if "config" in rec:
                continue
            kind, key = ("eval", "val_loss") if "val_loss" in rec else ("train", "loss")
            if key not in rec or not _loss_ok(rec[key]) or not _loss_ok(rec.get("loss_mean")):
                damaged += 1          # e.g. {"step": 1}: no loss to plot
                continue
            (evals if kind == "eval" else train)[rec["step"]] = rec
    if damaged:
        warnings.warn(f"{path}: {damaged} damaged line(s) skipped (a run killed while writing "
                      "leaves a torn line); the other records are read", RuntimeWarning,
                      stacklevel=2)
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def plot_loss_curve(metrics_path: str, png_path: str, title: str = "") -> str:
    """Train loss vs step (and validation loss points) from metrics.jsonl -> PNG; returns path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    if train:
        ax.plot([r["step"] for r in train], [_nan(r["loss"]) for r in train], alpha=0.5,
                label="train loss (logged step)")
        means = [(r["step"], r["loss_mean"]) for r in train if r.get("loss_mean") is not None]
        if means:
            ax.plot(*zip(*means), label="train loss (mean since previous record)")
    if evals:
        ax.plot([r["step"] for r in evals], [_nan(r["val_loss"]) for r in evals], "o-",
                label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:     # no records: no legend (and no warning)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
