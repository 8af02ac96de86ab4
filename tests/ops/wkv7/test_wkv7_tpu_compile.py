"""The WKV7 Mosaic kernels compiled by the real TPU compiler (XLA:TPU + Mosaic through libtpu, on
this CPU host: no TPU runs them) for v4, v5e, v5p and v6e: forward alone and forward + backward,
with and without segment ids and an initial state, bfloat16 / float32 / float16 inputs, every
precision name, every chunk length the op allows; and the sequence-parallel WKV on a 4-chip mesh
that splits T. Their numerics are tested in the interpreter (test_wkv7_tpu.py); this proves the
TPU compiler takes them. Each compile is listed in the run's "TPU compile" summary.

The variants of a group compile together: one program holds every variant's forward, another
every variant's forward + backward, each variant on inputs of its own (so no two of its kernels
can be merged), under a name scope of its own, and every output used. Each variant's Mosaic
calls are counted by that scope in the compiled HLO's op names (one forward kernel; a forward
saving states and a backward). Mosaic compiles each kernel on its own either way; one program
per pass spares XLA:TPU's fixed cost per program. A group that fails to compile is compiled
again one variant at a time to name the variant."""
import re

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


def _name(dtype, precision, chunk, seg, h0):
    return (f"wkv7 {jnp.dtype(dtype).name} {precision} C={chunk}"
            f"{' seg' if seg else ''}{' h0' if h0 else ''}")


def _scope(i):
    """The name scope of variant `i` of a group (fixed width: no scope is a prefix of another)."""
    return f"variant{i:02d}"


def _programs(cases):
    """`(forward, gradient)` of every case in `cases` at once: `forward(diff, ids)` returns each
    case's (output, final state); `gradient(diff, ids)` is the gradient of the sum of each
    case's loss with respect to `diff`, each case's (xs, initial state or None); `ids` holds
    each case's segment ids or None. Case `i` runs under the name scope `_scope(i)`."""
    def outputs(diff, ids):
        out = []
        for i, ((xs, state), seg, (_, precision, chunk, _, _)) in enumerate(zip(diff, ids, cases)):
            with jax.named_scope(_scope(i)):
                out.append(wkv7_tpu(*xs, state, seg, chunk, precision=precision))
        return out

    def loss(diff, ids):
        return sum(jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)
                   for o, s in outputs(diff, ids))
    return outputs, jax.grad(loss)


def _compile_group(devices, cases):
    """`((fwd, seconds), (fwd+bwd, seconds))` of the group's two programs; where one fails, the
    variant that fails it, compiled alone."""
    args = [_args(devices, dtype, seg, h0) for dtype, _, _, seg, h0 in cases]
    diff, ids = [(xs, state) for xs, state, _ in args], [seg for _, _, seg in args]
    try:
        return [tpu.compile_for(fn, diff, ids) for fn in _programs(cases)]
    except Exception:
        for case, d, i in zip(cases, diff, ids):
            for fn in _programs([case]):
                try:
                    tpu.compile_for(fn, [d], [i])
                except Exception as err:
                    raise AssertionError(f"{_name(*case)} does not compile") from err
        raise


def _calls_per_variant(compiled, n):
    """How many of the program's Mosaic calls each of its `n` variants owns (by the name scope
    in the call's op name); every call must belong to exactly one variant."""
    names = [re.search(r'op_name="([^"]*)"', line) for line in tpu.mosaic_calls(compiled)]
    owners = [[i for i in range(n) if m and _scope(i) in m.group(1)] for m in names]
    assert all(len(o) == 1 for o in owners), [m and m.group(1) for m in names]
    return [sum(o == [i] for o in owners) for i in range(n)]


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("generation", GENERATIONS)
def test_wkv7_kernels_compile_for_tpu(generation, group, record_property):
    cases = GROUPS[group]
    (fwd, s_fwd), (bwd, s_bwd) = _compile_group(tpu.devices(generation), cases)
    fwd_calls, bwd_calls = _calls_per_variant(fwd, len(cases)), _calls_per_variant(bwd, len(cases))
    for case, n_fwd, n_bwd in zip(cases, fwd_calls, bwd_calls):
        assert n_fwd == 1, _name(*case)         # the forward kernel
        assert n_bwd == 2, _name(*case)         # forward (saving states) + backward
    what = f"wkv7 {group} ({len(cases)} variants)"
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
