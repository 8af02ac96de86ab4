"""RoPE: float32 angles accurate at long positions, scaling rules, the rotation itself.

Error bound of `rope_cos_sin` against float64 (derived from its steps, see lwm_jax/layers/rope.py):
the 64-bit phase is exact up to the float64 rounding of `f / 2pi` (|p f| 2^-53 rad) and the
dropped low word (2^-32 turn = 1.5e-9 rad); the remainder angle |a| <= pi/4 becomes float32 with
three roundings (int -> float, the constant 2pi/2^32, the product): <= 3 * 2^-24 * pi/4 =
1.4e-7 rad; float32 cos/sin of it add their own error, <= 2 ulp of a result in [-1, 1]
(2 * 2^-24), and the quarter-turn swap is exact. Sum: < 4.4 * 2^-24 = 2.6e-7 for positions
< 2^24, so the test allows 4.5 * 2^-24.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.layers.rope import (apply_rope, inv_frequencies, naive_bf16_table,
                                 positions_from_segments, rope_cos_sin)

BOUND = 4.5 * 2.0**-24
LONG = [32768, 32769, 65535, 131071]


def _reference(positions, freqs):
    angles = np.asarray(positions, np.float64)[..., None] * np.asarray(freqs, np.float64)
    return np.cos(angles), np.sin(angles)


@pytest.mark.parametrize("theta,head_dim", [(10000.0, 128), (500000.0, 64)])
def test_bf16_table_is_far_off_at_long_positions_ours_is_within_ulps(theta, head_dim):
    freqs = inv_frequencies(head_dim, theta)
    cos_ref, sin_ref = _reference(LONG, freqs)
    table_cos, table_sin = naive_bf16_table(max(LONG) + 1, head_dim, theta)
    naive_err = max(np.abs(np.asarray(table_cos[np.array(LONG)], np.float64) - cos_ref).max(),
                    np.abs(np.asarray(table_sin[np.array(LONG)], np.float64) - sin_ref).max())
    assert naive_err > 1e-3, naive_err
    cos, sin = rope_cos_sin(jnp.asarray(LONG, jnp.int32), freqs)
    assert cos.dtype == sin.dtype == jnp.float32
    ours = max(np.abs(np.asarray(cos, np.float64) - cos_ref).max(),
               np.abs(np.asarray(sin, np.float64) - sin_ref).max())
    assert ours <= BOUND, (ours, BOUND)
    assert naive_err > 1000 * ours


def test_plain_float32_angles_are_not_enough():
    """What the fixed-point phase buys: `cos(float32(p) * float32(f))` at 32768 is off by
    ~1e-3 even before any bf16 rounding."""
    freqs = inv_frequencies(128, 10000.0)
    p = np.asarray(LONG, np.float32)[:, None]
    naive = np.cos((p * freqs.astype(np.float32)).astype(np.float64))
    assert np.abs(naive - _reference(LONG, freqs)[0]).max() > 1e-3


def test_cos_sin_within_bound_at_random_positions():
    rng = np.random.default_rng(0)
    positions = np.concatenate([np.arange(64), rng.integers(0, 2**24, 4000)]).astype(np.int32)
    for theta in (10000.0, 500000.0):
        freqs = inv_frequencies(128, theta)
        cos, sin = rope_cos_sin(jnp.asarray(positions), freqs)
        cos_ref, sin_ref = _reference(positions, freqs)
        assert np.abs(np.asarray(cos, np.float64) - cos_ref).max() <= BOUND
        assert np.abs(np.asarray(sin, np.float64) - sin_ref).max() <= BOUND


def test_rotation_matches_float64_and_keeps_the_norm():
    rng = np.random.default_rng(1)
    B, T, H, D = 2, 5, 3, 64
    positions = np.array([[0, 1, 2, 32768, 65535], [7, 4096, 100000, 2**20, 2**24 - 1]])
    x = rng.standard_normal((B, T, H, D)).astype(np.float32)
    freqs = inv_frequencies(D, 10000.0)
    cos, sin = rope_cos_sin(jnp.asarray(positions, jnp.int32), freqs)
    out = np.asarray(apply_rope(jnp.asarray(x), cos, sin), np.float64)

    c, s = (a[:, :, None, :] for a in _reference(positions, freqs))
    x1, x2 = x[..., : D // 2].astype(np.float64), x[..., D // 2:].astype(np.float64)
    ref = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    # each output = two products and a sum of float32 values: |x1|+|x2| times (angle bound +
    # two roundings)
    scale = np.concatenate([np.abs(x1) + np.abs(x2)] * 2, -1)
    assert np.all(np.abs(out - ref) <= scale * (BOUND + 2 * 2.0**-24))
    norms_in, norms_out = np.linalg.norm(x, axis=-1), np.linalg.norm(out, axis=-1)
    np.testing.assert_allclose(norms_out, norms_in, rtol=1e-6)


def test_rotation_casts_back_to_the_input_dtype():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 3, 2, 8)), jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.asarray([[0, 5, 40000]], jnp.int32), inv_frequencies(8, 1e4))
    out = apply_rope(x, cos, sin)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[:, 0]), np.asarray(x[:, 0]))   # position 0


def _loop_reference(head_dim, theta, kind, factor=1.0, low=1.0, high=4.0, original=8192):
    """The scaling formulas written element by element in float64 Python."""
    if kind == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    out = []
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        if kind == "linear":
            f = f / factor
        elif kind == "llama3":
            wavelength = 2 * math.pi / f
            if wavelength < original / high:
                pass
            elif wavelength > original / low:
                f = f / factor
            else:
                smooth = (original / wavelength - low) / (high - low)
                f = (1 - smooth) * f / factor + smooth * f
        out.append(f)
    return np.array(out)


@pytest.mark.parametrize("kind,factor", [("none", 1.0), ("linear", 4.0), ("ntk", 8.0),
                                         ("llama3", 8.0), ("llama3", 32.0)])
def test_scaling_rules_equal_their_float64_formulas(kind, factor):
    scaling = SimpleNamespace(kind=kind, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)
    for head_dim, theta in ((64, 500000.0), (128, 10000.0)):
        got = inv_frequencies(head_dim, theta, scaling)
        np.testing.assert_allclose(got, _loop_reference(head_dim, theta, kind, factor),
                                   rtol=1e-14, atol=0)
        plain = inv_frequencies(head_dim, theta)
        if kind == "linear":
            np.testing.assert_allclose(got, plain / factor, rtol=1e-15)
        if kind == "ntk":
            assert got[0] == plain[0] and np.all(got[1:] < plain[1:])


def test_llama3_rule_has_three_bands():
    s = SimpleNamespace(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)
    plain = inv_frequencies(128, 500000.0)
    got = inv_frequencies(128, 500000.0, s)
    ratio = got / plain
    assert np.any(ratio == 1.0) and np.any(ratio == 1 / 8)
    middle = (ratio < 1.0) & (ratio > 1 / 8)
    assert middle.sum() >= 2 and np.all(np.diff(ratio[middle]) < 0)


def test_positions_restart_at_each_segment():
    seg = jnp.asarray([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(np.asarray(positions_from_segments(seg)),
                                  [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="head_dim must be a positive even number"):
        inv_frequencies(7, 1e4)
    with pytest.raises(ValueError, match="rope_theta must be > 1"):
        inv_frequencies(8, 1.0)
    with pytest.raises(ValueError, match="scaling kind 'yarn'"):
        inv_frequencies(8, 1e4, SimpleNamespace(kind="yarn"))
