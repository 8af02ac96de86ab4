"""Deterministic, checkpointable sampler of [batch, ctx_len + 1] token windows.

Why not google `grain`: it fits functionally (seeded lazy shuffle, sharding, get_state), but it
adds four packages (one a native extension, array_record) and a noticeable import for what is ~150
lines here, and its shuffle order is not a documented contract, so a grain upgrade could silently
change which windows a resumed run sees. This sampler's order depends only on `permutation.py`.

Layout of one epoch (RWKV-LM style: fixed-length windows over the flat token stream, documents
packed back to back and separated by EOD token 0):
  * window w of epoch e starts at token `offset_e + w * ctx_len` and spans ctx_len + 1 tokens
    (inputs = window[:-1], targets = window[1:]); consecutive windows share one boundary token;
  * `offset_e` in [0, ctx_len) is a per-epoch shift (`random_offset=True`) so that different
    epochs cut the text at different places; with it off every epoch uses offset 0;
  * the order of windows is `permute(j, num_windows, key(seed, e))`, a seeded bijection;
  * global step s reads permuted positions [k*G, (k+1)*G) of epoch e = s // steps_per_epoch,
    k = s % steps_per_epoch, G = global_batch_size; the last (num_windows mod G) permuted
    positions of an epoch are skipped (the next epoch's permutation puts other windows there).
So the batch of a step is a pure function of (seed, step); the only state is the step counter.

Multi-host: host h of H takes rows [h*G/H, (h+1)*G/H) of every global batch, so the hosts read
disjoint windows and together form exactly the single-host batch.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from lwm_jax.data.permutation import derive_key, mix64, permute

_STATE_KEYS = ("step", "epoch", "seed", "num_windows", "global_batch_size", "ctx_len")


@dataclasses.dataclass(eq=False)
class WindowSampler:
    """Yields int32 [global_batch_size // host_count, ctx_len + 1] windows of `tokens`.

    Args:
      tokens: 1-D integer array (a `np.memmap` is read lazily; only the windows are copied).
      ctx_len: T, the model's training context; windows hold T + 1 tokens.
      global_batch_size: G, windows per step summed over all hosts.
      seed: selects the window order and the per-epoch offsets.
      host_index / host_count: this host's slice of the global batch.
      shuffle: permute windows (False = in order, for sequential evaluation).
      random_offset: shift window boundaries by a seeded offset per epoch.
    """

    tokens: np.ndarray = dataclasses.field(repr=False)
    ctx_len: int
    global_batch_size: int
    seed: int = 0
    host_index: int = 0
    host_count: int = 1
    shuffle: bool = True
    random_offset: bool = True
    step: int = 0

    def __post_init__(self) -> None:
        if np.ndim(self.tokens) != 1:
            raise ValueError(f"tokens must be 1-D, got shape {np.shape(self.tokens)}")
        if np.asarray(self.tokens[:0]).dtype.kind not in "iu":
            raise TypeError(f"tokens must be integers, got dtype {np.asarray(self.tokens[:0]).dtype}")
        for name in ("ctx_len", "global_batch_size", "host_count"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.host_index < self.host_count:
            raise ValueError(f"host_index must lie in [0, host_count={self.host_count}), got {self.host_index}")
        if self.global_batch_size % self.host_count:
            raise ValueError(f"global_batch_size={self.global_batch_size} must be divisible by "
                             f"host_count={self.host_count}")
        n_tok, T = len(self.tokens), int(self.ctx_len)
        # largest window start must satisfy start + T + 1 <= n_tok for every offset in use
        max_offset = T - 1 if self.random_offset else 0
        self.num_windows = max((n_tok - 1 - max_offset) // T, 0)
        self.steps_per_epoch = self.num_windows // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"tokens hold {self.num_windows} windows of ctx_len+1={T + 1} tokens ({n_tok} tokens), fewer than "
                f"global_batch_size={self.global_batch_size}: use more data, a smaller batch or a shorter ctx_len")

    # ------------------------------------------------------------------ pure functions of step
    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.host_count

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def epoch_offset(self, epoch: int) -> int:
        """Token offset of window 0 in `epoch` (0 when random_offset is False)."""
        if not self.random_offset:
            return 0
        return mix64(derive_key(self.seed, epoch, 1)) % int(self.ctx_len)

    def window_starts(self, step: int) -> np.ndarray:
        """int64 [local_batch_size]: first token index of each of this host's windows at `step`."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        epoch, k = divmod(int(step), self.steps_per_epoch)
        b = self.local_batch_size
        pos = k * self.global_batch_size + self.host_index * b + np.arange(b, dtype=np.int64)
        win = permute(pos, self.num_windows, derive_key(self.seed, epoch, 0)) if self.shuffle else pos
        return self.epoch_offset(epoch) + win * int(self.ctx_len)

    def batch_at(self, step: int) -> np.ndarray:
        """int32 [local_batch_size, ctx_len + 1] windows of `step` (does not touch `self.step`)."""
        width = int(self.ctx_len) + 1
        starts = self.window_starts(step)
        out = np.empty((len(starts), width), dtype=np.int32)
        for row, s in enumerate(starts):
            out[row] = self.tokens[s: s + width]
        return out

    # ------------------------------------------------------------------ stateful iteration
    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Tiny dict saved with checkpoints; `load_state_dict` resumes at exactly the next batch."""
        return {"step": int(self.step), "epoch": int(self.epoch), "seed": int(self.seed),
                "num_windows": int(self.num_windows), "global_batch_size": int(self.global_batch_size),
                "ctx_len": int(self.ctx_len)}

    def load_state_dict(self, state: dict) -> None:
        """Restores `step`; refuses a state from a different seed / data / batch / context."""
        if "sources" in state:
            raise ValueError("data: the checkpoint's batches came from data.sources / text "
                             "sources, this run reads one binidx file; resume with the same data "
                             "settings or choose a new run_dir")
        missing = [k for k in ("step",) if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks key(s) {missing}; expected keys {_STATE_KEYS}")
        for key in _STATE_KEYS[2:]:
            if key in state and int(state[key]) != int(getattr(self, key)):
                raise ValueError(
                    f"sampler state has {key}={int(state[key])} but this sampler has {key}={getattr(self, key)}; "
                    f"resuming would not reproduce the data order (restore with the same data and settings)")
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"sampler state step must be non-negative, got {step}")
        self.step = step


def split_train_val(tokens: np.ndarray, val_fraction: float,
                    boundaries: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Splits a flat token array into (train, val) views; val is the last `val_fraction`.

    `boundaries` (sorted token offsets where documents start, e.g.
    `BinIdxDataset.sequence_bounds()`) moves the cut to the nearest document boundary so no
    document straddles the split. Both results are views (memmaps stay memmaps).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    n = len(tokens)
    cut = n - int(round(n * val_fraction))
    if boundaries is not None and 0 < cut < n:
        b = np.asarray(boundaries, dtype=np.int64)
        b = b[(b > 0) & (b < n)]
        if b.size:
            cut = int(b[np.argmin(np.abs(b - cut))])
    return tokens[:cut], tokens[cut:]
