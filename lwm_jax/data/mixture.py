"""Global batches drawn from weighted window sources, deterministic and exactly resumable.

Row r of global step s (global row index `i = s * G + r`) comes from source
`searchsorted(cumulative weights / total, u_i)` with `u_i = mix64(key(seed, i, 2)) / 2^64`,
a pure function of (seed, i); that source then gives its next window
(`lwm_jax.data.stream`). Over many rows each source supplies its weight's share of windows.

Every host computes every row of the global batch (so that every source advances identically
everywhere) and keeps its own slice `[h * G/H, (h+1) * G/H)`, like `WindowSampler`. For text
sources that means each host tokenises the whole global batch: cheap next to a train step for
the context lengths used here, and it keeps the batches independent of the host count, so a
checkpoint resumes on another number of processes.

State (`state_dict`, JSON, saved with every checkpoint): the step and every source's state.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from lwm_jax.data.permutation import derive_key, mix64
from lwm_jax.data.stream import WindowSource


class MixtureSampler:
    """Yields int32 `[global_batch_size // host_count, ctx_len + 1]` batches (the interface of
    `WindowSampler` that the trainer uses: `next`, `step`, `state_dict`, `load_state_dict`).

    sources: the window sources; weights: one positive number each (normalised here).
    """

    def __init__(self, sources: Sequence[WindowSource], weights: Sequence[float], *,
                 global_batch_size: int, seed: int = 0, host_index: int = 0,
                 host_count: int = 1):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"data.weights: {len(weights)} weights for {len(sources)} sources; "
                             "give one weight per source")
        if any(not w > 0 for w in weights):
            raise ValueError(f"data.weights: every weight must be > 0, got {list(weights)}")
        if global_batch_size % host_count:
            raise ValueError(f"global_batch_size={global_batch_size} must be divisible by "
                             f"host_count={host_count}")
        self.sources, self.seed = list(sources), int(seed)
        self.weights = [float(w) for w in weights]
        self.cumulative = _cumulative_shares(self.weights)
        self.global_batch_size, self.host_index = int(global_batch_size), int(host_index)
        self.host_count, self.step = int(host_count), 0

    def source_of(self, row: int) -> int:
        """Index of the source that global row `row` is drawn from."""
        u = mix64(derive_key(self.seed, row, 2)) / 2.0**64
        return min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.sources) - 1)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        G = self.global_batch_size
        rows = [self.sources[self.source_of(self.step * G + r)].next_window() for r in range(G)]
        self.step += 1
        b = G // self.host_count
        return np.stack(rows[self.host_index * b:(self.host_index + 1) * b])

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.seed, "weights": self.weights,
                "global_batch_size": self.global_batch_size,
                "sources": [{"name": s.name, **s.state_dict()} for s in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly after the checkpoint's batch; refuses another seed, batch size, source
        list or weighting (one-line ValueError)."""
        names = [s.get("name") for s in state.get("sources", [])]
        mine = [s.name for s in self.sources]
        for key, want, got in (("train.seed", state.get("seed"), self.seed),
                               ("train.batch_size", state.get("global_batch_size"),
                                self.global_batch_size),
                               ("data.weights", state.get("weights"), self.weights),
                               ("data.sources", names, mine)):
            if want != got:
                raise ValueError(f"{key}: the checkpoint's data order used {str(want)[:120]}, "
                                 f"this run {str(got)[:120]}; resume with the same data settings "
                                 "or choose a new run_dir")
        for source, saved in zip(self.sources, state["sources"]):
            source.load_state_dict({k: v for k, v in saved.items() if k != "name"})
        self.step = int(state["step"])


def _cumulative_shares(weights: Sequence[float]) -> np.ndarray:
    """Cumulative shares of `weights` (last = 1). Scaled by the largest weight first, so
    weights near float64's limit (1e308 twice once summed to inf and sent every row to one
    source) keep their ratios; a weight too small beside the others to ever be drawn is a
    one-line ValueError."""
    w = np.asarray(weights, np.float64)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"data.weights: every weight must be finite, got {list(weights)}")
    total = float(np.sum(w))
    if np.isfinite(total):       # the ordinary case, computed as before (a resume draws alike)
        share = w / total
        cumulative = np.cumsum(w) / total
    else:
        share = (w / w.max()) / np.sum(w / w.max())
        cumulative = np.cumsum(share)
    if np.any(share < 2.0**-52):
        raise ValueError(f"data.weights: {list(weights)}: a source's share is below 2^-52 "
                         "of the rows, so it would never be drawn; give weights of "
                         "comparable size")
    if not np.isfinite(total):
        cumulative[-1] = 1.0
    return cumulative
