"""Splash attention compiled by the real TPU compiler (libtpu on this CPU host, no TPU) for v4,
v5e, v5p and v6e, forward + backward, causal and packed documents, grouped heads; on one chip and
per chip inside the `shard_map` a 4-chip mesh gets (`attention_tpu.splash_self_attention_sharded`).
Numerics: test_attention_tpu.py (interpreter). Each compile is listed in the run's summary."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwm_jax.aot import testing as tpu
from lwm_jax.layers.attention import self_attention
from lwm_jax.train.sharding import make_mesh

pytestmark = pytest.mark.tpu_compile
B, T, H, K, D = 4, 512, 4, 2, 64


def _loss(mesh, with_segments):
    def loss(q, k, v, seg):
        out = self_attention(q, k, v, precision="default", platform="tpu", mesh=mesh,
                             segment_ids_BT=seg if with_segments else None)
        return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("generation", tuple(tpu.GENERATIONS))
def test_splash_attention_compiles_for_tpu(generation, record_property):
    one = jax.sharding.Mesh(np.array(tpu.devices(generation)[:1]), ("x",))
    sh = NamedSharding(one, P())
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh)
    for with_segments in (False, True):
        compiled, seconds = tpu.compile_for(_loss(None, with_segments), q, kv, kv, seg)
        calls = tpu.mosaic_calls(compiled)
        assert len(calls) >= 3        # forward, dQ, dK/dV kernels
        tpu.report(record_property, generation, f"splash attention bf16 T={T} H={H} K={K}"
                   f"{' segments' if with_segments else ''} fwd+bwd", compiled, seconds)


@pytest.mark.parametrize("generation", tuple(tpu.GENERATIONS))
def test_splash_attention_runs_per_chip_on_a_mesh(generation, record_property):
    """data 2 x tensor 2: each chip's kernels see B/2 rows of H/2 query heads (no gather)."""
    mesh = make_mesh({"data": 2, "fsdp": 1, "tensor": 2, "sequence": 1},
                     list(tpu.devices(generation, 4)))
    sh = NamedSharding(mesh, P("data", None, "tensor", None))
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=sh)
    kv = jax.ShapeDtypeStruct((B, T, K, D), jnp.bfloat16, sharding=sh)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    compiled, seconds = tpu.compile_for(_loss(mesh, True), q, kv, kv, seg)
    calls = tpu.mosaic_calls(compiled)
    assert calls and "all-gather" not in compiled.as_text()
    # the forward kernel's query operand: one row's H/2 heads ([H/2, T, D]) per vmapped call
    assert any(f"[{H // 2},{T},{D}]" in line for line in calls), calls[0][:300]
    assert not any(f"[{H},{T},{D}]" in line or f"[{B},{T}" in line for line in calls)
    tpu.report(record_property, generation, "splash attention on data 2 x tensor 2 fwd+bwd",
               compiled, seconds)
