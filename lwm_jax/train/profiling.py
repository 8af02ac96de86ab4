"""`jax.profiler` traces of training steps: one helper for `lwm-jax train` and the benchmarks.

`train.profile_steps: [start, stop]` traces the optimizer steps `start .. stop-1` (0-based: the
step that takes the state from step `s` to `s + 1` is step `s`; the first step of each `train`
call, step 0 or the resumed one, includes compilation)
into `<run_dir>/profile/plugins/profile/<timestamp>/`: an XPlane file (`*.xplane.pb`, for
TensorBoard's profile plugin or XProf) and `perfetto_trace.json.gz` (drop it on
ui.perfetto.dev). The trace ends after the last traced step's results are on the host, so it
holds the device work of every step in the window. A run resumed inside the window traces the
rest of it; one resumed past it traces nothing. Only process 0 traces (a trace names its host,
and two processes of one host would write the same file).

The model code wraps its pieces in `jax.named_scope` (RWKV-7: `embed`, `block_norm`,
`time_mix`, `wkv`, `channel_mix`; Llama: `attention`, `mlp`; both: `head`; the step: `loss`,
`optimizer`), so the ops of a trace carry names like `jit(step)/.../time_mix/wkv/...`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import jax

PROFILE_DIR = "profile"


@contextlib.contextmanager
def trace(out_dir: str) -> Iterator[None]:
    """Trace everything inside the block into `out_dir` (XPlane + Perfetto JSON); the caller
    blocks on the block's results before leaving it, so their device work is in the trace."""
    os.makedirs(out_dir, exist_ok=True)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        yield


class StepWindowProfiler:
    """Starts a trace before step `start` and stops it after step `stop - 1` (see the module
    docstring). Call `before(step)` before running step `step`, `after(step, result)` once it
    returned (`result`: any pytree of its outputs), and `close()` at the end of the loop (stops
    a trace that the loop left early). The results of the step before the window and of its
    last step are waited for, so the trace holds the window's device work and no other step's.

    window: `(start, stop)` or None (then every call is a no-op); out_dir: the trace directory;
    enabled: False on processes other than 0.
    """

    def __init__(self, window: tuple[int, int] | None, out_dir: str, *, enabled: bool = True):
        self.window = tuple(window) if window is not None and enabled else None
        self.out_dir = out_dir
        self._active: contextlib.AbstractContextManager | None = None
        self.traced_steps: list[int] = []

    def before(self, step: int) -> None:
        if self.window is None or self._active is not None:
            return
        start, stop = self.window
        if start <= step < stop:
            self._active = trace(self.out_dir)
            self._active.__enter__()

    def after(self, step: int, result: Any) -> None:
        if self._active is None:
            if self.window is not None and step + 1 == self.window[0]:
                jax.block_until_ready(result)     # the step before the window stays out
            return
        self.traced_steps.append(step)
        if step + 1 >= self.window[1]:
            jax.block_until_ready(result)
            self._stop()

    def close(self) -> None:
        if self._active is not None:
            self._stop()

    def _stop(self) -> None:
        active, self._active = self._active, None
        active.__exit__(None, None, None)
