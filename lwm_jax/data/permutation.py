"""Stateless, seeded permutations of `range(n)`, evaluated one index at a time.

`permute(index, n, key)` is a bijection of [0, n) chosen by the 64-bit `key`: a balanced Feistel
network on the smallest even number of bits covering n, with cycle walking (re-apply until the
value lands below n; the domain is < 4n so this takes < 4 rounds on average). Memory is O(batch),
not O(n), so a trillion-token corpus needs no permutation table, and the order depends only on
this file's arithmetic (never on NumPy's RNG streams, which may change between releases).
"""
from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
_ROUNDS = 6


def mix64(x: int) -> int:
    """SplitMix64 finaliser on a Python int (a well-spread 64-bit hash of x mod 2^64)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    """Folds integers (seed, epoch, stream id, ...) into one 64-bit key."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = mix64(h ^ mix64(int(p) & _M64) ^ ((int(p) >> 64) & _M64))
    return h


def _mix64_u64(x: np.ndarray) -> np.ndarray:
    """`mix64` on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feistel(x: np.ndarray, half_bits: int, round_keys: list[int]) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    left = x >> shift
    right = x & mask
    for rk in round_keys:
        f = _mix64_u64(right ^ np.uint64(rk)) & mask
        left, right = right, left ^ f
    return (left << shift) | right


def permute(index, n: int, key: int) -> np.ndarray:
    """Image of `index` (int or int array, values in [0, n)) under the permutation `key` of [0, n).

    Returns int64 with the shape of `index`.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    idx = np.asarray(index, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"index must lie in [0, {n}), got range [{idx.min()}, {idx.max()}]")
    if n == 1:
        return np.zeros_like(idx)
    bits = max(int(n - 1).bit_length(), 2)
    bits += bits & 1
    round_keys = [mix64(key + r * 0x632BE59BD9B4E019) for r in range(_ROUNDS)]
    x = np.atleast_1d(idx).astype(np.uint64)
    out = _feistel(x, bits // 2, round_keys)
    todo = out >= np.uint64(n)
    while np.any(todo):
        out[todo] = _feistel(out[todo], bits // 2, round_keys)
        todo = out >= np.uint64(n)
    return out.astype(np.int64).reshape(idx.shape)
