"""Rotary position embedding (RoPE) whose angles stay accurate at long positions.

Frequencies: `inv_frequencies(head_dim, theta, scaling)` returns the `D/2` rotation speeds
(radians per position) as float64 NumPy, computed on the host from the config: plain
`theta ** (-2i / D)`, or one of the scalings

  linear  every frequency divided by `factor` (positions compressed by `factor`);
  ntk     "NTK-aware" base change without a dynamic part: `theta * factor ** (D / (D - 2))`;
  llama3  LLaMA-3.1's band rule: wavelengths longer than `original_max_position_embeddings /
          low_freq_factor` are slowed by `factor`, shorter than `... / high_freq_factor` kept,
          and the band between blended linearly in `original / wavelength`.

`scaling` is any object with the attributes `kind` ("none" | "linear" | "ntk" | "llama3"),
`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings` (e.g.
`lwm_jax.models.llama.config.RopeScaling`), or None.

Angles: `cos(p * f)` in float32 loses everything at long positions if it is formed the obvious
way: at p = 32768 the float32 product `p * f` is off by up to ulp(32768) / 2 = 2e-3 rad, and a
bf16 table adds up to 2^-8 relative on top. Here the angle is never formed as a large float.
Each frequency is stored as a 64-bit fixed-point phase step `G = frac(f / 2pi) * 2^64` (two
uint32 words); the phase of position p is `p * G mod 2^64` in exact wrapping uint32
arithmetic (whole turns drop out for free), its top 32 bits are rounded to the nearest quarter
turn `q` and a signed remainder `r` in [-1/8, 1/8) turn, and only `r` becomes a float32 angle in
[-pi/4, pi/4) (relative error <= 3 * 2^-24). cos and sin of that small angle are then swapped
and negated exactly for the quarter turn `q`. Result: cos and sin within a few float32 ulp of
float64 at any int32 position (the test derives the bound), all in float32.

Rotation: `apply_rope` uses the "rotate half" pairing of Hugging Face LLaMA (element i pairs
with element i + D/2), rotates in float32 and casts the result once to the input's dtype.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SCALING_KINDS = ("none", "linear", "ntk", "llama3")
_TWO_PI = 2.0 * math.pi
_QUARTER_ANGLE = np.float32(_TWO_PI * 2.0**-32)   # radians per unit of the 32-bit phase word


def inv_frequencies(head_dim: int, theta: float, scaling: Any = None) -> np.ndarray:
    """Rotation speed of each of the `head_dim / 2` pairs, radians per position (float64).

    Args:
      head_dim: D (even).
      theta: the RoPE base (10000 in LLaMA-1/2, 500000 in LLaMA-3).
      scaling: None or an object with `kind`, `factor`, `low_freq_factor`,
        `high_freq_factor`, `original_max_position_embeddings` (see the module docstring).
    Returns:
      float64 `[D/2]`, decreasing.
    """
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope: head_dim must be a positive even number, got {head_dim}")
    if not theta > 1.0:
        raise ValueError(f"rope: rope_theta must be > 1, got {theta}")
    kind = "none" if scaling is None else scaling.kind
    if kind not in SCALING_KINDS:
        raise ValueError(f"rope: scaling kind {kind!r} is not one of {SCALING_KINDS}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    if kind == "ntk":
        theta = theta * float(scaling.factor) ** (head_dim / (head_dim - 2))
    freqs = theta ** -exponents
    if kind == "linear":
        freqs = freqs / float(scaling.factor)
    elif kind == "llama3":
        freqs = _llama3_band_rule(freqs, scaling)
    return freqs


def _llama3_band_rule(freqs: np.ndarray, s: Any) -> np.ndarray:
    """LLaMA-3.1's per-band frequency scaling (float64)."""
    original = float(s.original_max_position_embeddings)
    factor, low, high = float(s.factor), float(s.low_freq_factor), float(s.high_freq_factor)
    wavelength = _TWO_PI / freqs
    long_wave = wavelength > original / low             # low frequencies: slowed by factor
    short_wave = wavelength < original / high           # high frequencies: untouched
    blend = (original / wavelength - low) / (high - low)
    middle = (1.0 - blend) * freqs / factor + blend * freqs
    return np.where(long_wave, freqs / factor, np.where(short_wave, freqs, middle))


def phase_steps(freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-point phase step of each frequency: `G = round(frac(f / 2pi) * 2^64) mod 2^64`,
    returned as its high and low uint32 words `[D/2]` each (host NumPy)."""
    hi, lo = [], []
    for f in np.asarray(freqs, np.float64):
        turns = float(f) / _TWO_PI
        step = int(round(math.ldexp(turns - math.floor(turns), 64))) % (1 << 64)
        hi.append(step >> 32)
        lo.append(step & 0xFFFFFFFF)
    return np.asarray(hi, np.uint32), np.asarray(lo, np.uint32)


def _mul_high(a, b):
    """High 32 bits of the 64-bit product of two uint32 arrays (16-bit limbs, no overflow)."""
    mask = jnp.uint32(0xFFFF)
    a1, a0 = a >> 16, a & mask
    b1, b0 = b >> 16, b & mask
    cross1, cross0 = a1 * b0, a0 * b1
    carry = ((a0 * b0) >> 16) + (cross1 & mask) + (cross0 & mask)
    return a1 * b1 + (cross1 >> 16) + (cross0 >> 16) + (carry >> 16)


def rope_cos_sin(positions, freqs: np.ndarray):
    """cos and sin of `positions * freqs`, float32, accurate at any int32 position.

    Args:
      positions: int `[...]` (>= 0; token positions, e.g. `[B, T]`).
      freqs: float64 `[D/2]` from `inv_frequencies` (host constants).
    Returns:
      `(cos, sin)`, float32 `[..., D/2]` each.
    """
    step_hi, step_lo = phase_steps(freqs)
    p = jnp.asarray(positions).astype(jnp.uint32)[..., None]
    phase = _mul_high(p, jnp.asarray(step_lo)) + p * jnp.asarray(step_hi)   # wraps mod 2^32
    # Nearest quarter turn q (top two bits after adding 1/8 turn) and the signed remainder.
    quarter = (phase + jnp.uint32(1 << 29)) >> 30
    rest = jax.lax.bitcast_convert_type(phase - (quarter << 30), jnp.int32)   # [-2^29, 2^29)
    angle = rest.astype(jnp.float32) * _QUARTER_ANGLE                       # [-pi/4, pi/4)
    c, s = jnp.cos(angle), jnp.sin(angle)
    q = quarter.astype(jnp.int32)
    cos = jnp.select([q == 0, q == 1, q == 2], [c, -s, -c], s)
    sin = jnp.select([q == 0, q == 1, q == 2], [s, c, -s], -c)
    return cos, sin


def apply_rope(x_BTHD, cos_BTK, sin_BTK):
    """Rotate each head's pairs `(x[i], x[i + D/2])` by the angles of `cos`/`sin`.

    Args:
      x_BTHD: `[B, T, H, D]` any float dtype.
      cos_BTK, sin_BTK: float32 `[B, T, D/2]` (`rope_cos_sin`).
    Returns:
      `[B, T, H, D]` in `x_BTHD.dtype` (rotation computed in float32, cast once).
    """
    half = x_BTHD.shape[-1] // 2
    if cos_BTK.shape[-1] != half or x_BTHD.shape[-1] % 2:
        raise ValueError(f"rope: head_dim {x_BTHD.shape[-1]} does not match {cos_BTK.shape[-1]} "
                         "frequencies (head_dim must be 2 x frequencies)")
    x32 = x_BTHD.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos_BTK[:, :, None, :], sin_BTK[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x_BTHD.dtype)


def naive_bf16_table(max_len: int, head_dim: int, theta: float):
    """The table most small GPT codebases build, kept for comparisons: frequencies and angles
    `t * f` in float32, cos/sin stored in bfloat16. Returns `(cos, sin)` bf16 `[max_len, D/2]`.
    Not used by any model here."""
    freqs = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.outer(jnp.arange(max_len, dtype=jnp.float32), freqs)
    return jnp.cos(angles).astype(jnp.bfloat16), jnp.sin(angles).astype(jnp.bfloat16)


def positions_from_segments(segment_ids_BT):
    """Position of every token inside its packed document: 0 where the id changes (and at
    t = 0), counting up until the next change. int32 `[B, T]`."""
    seg = jnp.asarray(segment_ids_BT)
    T = seg.shape[1]
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), seg.shape)
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
