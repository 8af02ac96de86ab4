"""The Mosaic GPU chunk maps (`lwm_jax/ops/wkv7/mosaic_gpu/pair_maps.py`) and the output chain
they feed, against the float64 reference.

GPU only (Hopper, jax >= 0.11): skipped on CPU, on older jax and where the package does not
import. Inputs are fresh RWKV-7-like random tensors (`testing.random_wkv7_inputs`), never zeros.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lwm_jax.ops.wkv7.reference import wkv7_reference_np
from lwm_jax.ops.wkv7.testing import rel_err, random_wkv7_inputs

pytestmark = pytest.mark.gpu


def _mosaic():
    if jax.devices()[0].platform != "gpu":
        pytest.skip("needs a CUDA GPU")
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        pytest.skip("needs an sm_90 (Hopper) GPU")
    try:
        from lwm_jax.ops.wkv7.mosaic_gpu import pair_maps  # noqa: F401
    except ImportError as err:
        pytest.skip(f"mosaic_gpu kernel does not import: {err}")


@pytest.mark.parametrize("B,T,H,with_state", [(1, 1024, 4, False), (2, 256, 3, True)])
def test_pair_maps_forward_matches_float64(B, T, H, with_state):
    # the two-chunks-per-CTA chunk maps feeding the Mosaic output chain: o within the bf16
    # rounding of the float64 recurrence, the final state to the chain's float32 accuracy
    _mosaic()
    from lwm_jax.ops.wkv7.mosaic_gpu import pair_maps as pm
    from lwm_jax.ops.wkv7.mosaic_gpu import state_pass as sp
    r, w, k, v, a, b = random_wkv7_inputs(T + 7 * B + H, B, T, H, 64, 64, jnp.float32)
    xs = [x.astype(jnp.bfloat16) for x in (r, k, v, a, b)]
    s0 = (0.5 * jax.random.normal(jax.random.PRNGKey(T + 1), (B, H, 64, 64), jnp.float32)
          if with_state else jnp.zeros((B, H, 64, 64), jnp.float32))
    maps = pm.pair_maps(*xs, pm.chunk_log_decay(w))
    o, sT = sp.forward_outputs(*maps, s0, H=H)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    ref_o, ref_s = wkv7_reference_np(f64(xs[0]), f64(w), *[f64(x) for x in xs[1:]],
                                     initial_state=f64(s0))
    rounding = rel_err(f64(jnp.asarray(ref_o, jnp.float32).astype(jnp.bfloat16)), ref_o)
    assert o.dtype == jnp.bfloat16 and o.shape == (B, T, H, 64)
    assert rel_err(o, ref_o) < 1.1 * rounding + 1e-4
    assert rel_err(sT, ref_s) < 2e-5


def test_pair_maps_rejects_a_length_not_a_multiple_of_64():
    _mosaic()
    from lwm_jax.ops.wkv7.mosaic_gpu import pair_maps as pm
    x = jnp.zeros((1, 96, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64"):
        pm.pair_maps(x, x, x, x, x, jnp.zeros((1, 96, 2, 64), jnp.float32))
