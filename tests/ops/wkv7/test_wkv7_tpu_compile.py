"""The WKV7 Mosaic kernels compiled by the real TPU compiler (XLA:TPU + Mosaic through libtpu, on
this CPU host: no TPU runs them) for v4, v5e, v5p and v6e: forward alone and forward + backward,
with and without segment ids and an initial state, bfloat16 / float32 / float16 inputs, every
precision name, every chunk length the op allows; and the sequence-parallel WKV on a 4-chip mesh
that splits T. Their numerics are tested in the interpreter (test_wkv7_tpu.py); this proves the
TPU compiler takes them. Each compile is listed in the run's "TPU compile" summary."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwm_jax.aot import testing as tpu
from lwm_jax.ops.wkv7.contract import PRECISIONS, TPU_MAX_CHUNK
from lwm_jax.ops.wkv7.pallas_tpu.op import wkv7_tpu
from lwm_jax.ops.wkv7.sequence_parallel import wkv7_sequence_parallel
from lwm_jax.train.sharding import make_mesh

pytestmark = pytest.mark.tpu_compile
GENERATIONS = tuple(tpu.GENERATIONS)
B, T, H, K = 2, 256, 2, 64
CHUNKS = tuple(range(16, TPU_MAX_CHUNK + 1, 16))
DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)

# (dtype, precision, chunk, segment ids, initial state): every chunk length (bf16, both extras),
# every dtype x precision (chunk 64), every extras combination; forward + backward each.
CASES = ([(jnp.bfloat16, "highest", c, True, True) for c in CHUNKS]
         + [(d, p, 64, False, False) for d in DTYPES for p in PRECISIONS]
         + [(jnp.bfloat16, "default", 32, s, h) for s in (False, True) for h in (False, True)])
GROUPS = {"chunks": CASES[:len(CHUNKS)], "dtypes": CASES[len(CHUNKS):-4], "extras": CASES[-4:]}


def _args(devices, dtype, seg, h0):
    one = NamedSharding(jax.sharding.Mesh(np.array(devices[:1]), ("x",)), P())
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)  # noqa: E731
    xs = [sds((B, T, H, K), dtype) for _ in range(6)]
    return (xs, sds((B, H, K, K), jnp.float32) if h0 else None,
            sds((B, T), jnp.int32) if seg else None)


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("generation", GENERATIONS)
def test_wkv7_kernels_compile_for_tpu(generation, group, record_property):
    devices = tpu.devices(generation)
    for dtype, precision, chunk, seg, h0 in GROUPS[group]:
        xs, state, ids = _args(devices, dtype, seg, h0)

        def forward(xs, state, ids):
            return wkv7_tpu(*xs, state, ids, chunk, precision=precision)

        def loss(xs, state, ids):
            o, s = forward(xs, state, ids)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)
        argnums = (0, 1) if h0 else 0
        what = (f"wkv7 {jnp.dtype(dtype).name} {precision} C={chunk}"
                f"{' seg' if seg else ''}{' h0' if h0 else ''}")
        fwd, s_fwd = tpu.compile_for(forward, xs, state, ids)
        bwd, s_bwd = tpu.compile_for(jax.grad(loss, argnums=argnums), xs, state, ids)
        assert len(tpu.mosaic_calls(fwd)) == 1, what           # the forward kernel
        assert len(tpu.mosaic_calls(bwd)) == 2, what           # forward (saving states) + backward
        tpu.report(record_property, generation, what + " fwd", fwd, s_fwd)
        tpu.report(record_property, generation, what + " fwd+bwd", bwd, s_bwd)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_sequence_parallel_wkv7_compiles_on_a_mesh_that_splits_time(generation,
                                                                    record_property):
    """T split over `sequence` = 2 and heads over `tensor` = 2 on 4 chips: the kernels run per
    chip inside the shard_map, the slices' state maps are all-gathered over `sequence`."""
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 2, "sequence": 2},
                     list(tpu.devices(generation, 4)))
    x_sh = NamedSharding(mesh, P(None, "sequence", "tensor", None))
    xs = [jax.ShapeDtypeStruct((B, 2 * T, H, K), jnp.bfloat16, sharding=x_sh)
          for _ in range(6)]
    seg = jax.ShapeDtypeStruct((B, 2 * T), jnp.int32,
                               sharding=NamedSharding(mesh, P(None, "sequence")))

    def loss(xs, seg):
        o = wkv7_sequence_parallel(*xs, mesh=mesh, segment_ids=seg, head_axis="tensor",
                                   impl="pallas", precision="highest")
        return jnp.sum(o.astype(jnp.float32) ** 2)
    compiled, seconds = tpu.compile_for(jax.grad(loss), xs, seg)
    text = compiled.as_text()
    calls = tpu.mosaic_calls(compiled)
    # two passes (values, identity) forward and backward: four kernels of each kind
    assert len(calls) >= 4 and "all-gather" in text
    # every kernel sees its chip's slice: T/2 positions of H/2 heads of each row
    assert all(f"[{B * H // 2},{T}," in line.split("custom-call(")[0] for line in calls), calls[0]
    tpu.report(record_property, generation, "wkv7 sequence-parallel (tensor 2 x sequence 2) "
               "fwd+bwd", compiled, seconds)
