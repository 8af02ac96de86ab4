"""The precision policy reaches the WKV op: each preset's `wkv_precision` is the precision of
the in-chunk matmuls every chunked path actually runs (read from the traced program: on CPU all
precisions compute the same numbers)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from lwm_jax.ops.wkv7 import wkv7
from lwm_jax.ops.wkv7.pallas_gpu import tf32_round
from lwm_jax.ops.wkv7.testing import random_wkv7_inputs
from lwm_jax.precision import PRESETS, parse_policy

P = jax.lax.Precision


ROUNDED = ("rounded-tf32",) * 2   # the compiled GPU kernels' TF32 products (`tf32_round`)


def _dot_precisions(jaxpr, inside=False, within="", out=None):
    """Precision of every dot_general, recursing into sub-jaxprs (pjit, scan, checkpoint,
    custom_vjp, pallas_call ...); only those under an equation whose name contains `within`.
    A TF32 product whose operands the GPU kernel rounds itself counts as `ROUNDED`."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name", eqn.params.get("name_and_src_info", ""))
        here = inside or within in str(name)
        if eqn.primitive is tf32_round.rounded_dot_p and inside:
            out.append((ROUNDED, False))
        if eqn.primitive.name == "dot_general" and inside:
            (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
            out.append((eqn.params["precision"], bool(lhs_batch)))
        for value in eqn.params.values():
            for x in (value if isinstance(value, (list, tuple)) else (value,)):
                sub = x.jaxpr if isinstance(x, jex_core.ClosedJaxpr) else x
                if isinstance(sub, jex_core.Jaxpr):
                    _dot_precisions(sub, here, within, out)
    return out


def test_presets_state_the_wkv_precision():
    assert {n: p.wkv_precision for n, p in PRESETS.items()} == {
        "fp32": "highest", "fp32-fast": "high", "bf16-mixed": "high", "fp16-mixed": "high",
        "bf16": "high", "fp8-mixed": "high"}
    assert parse_policy("p=f32,c=bf16,w=default").wkv_precision == "default"
    assert parse_policy("p=f32,c=f32").wkv_precision == "highest"
    with pytest.raises(ValueError, match="WKV matmul precision 'fast'"):
        parse_policy("p=f32,c=bf16,w=fast")


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_each_path_runs_the_presets_wkv_precision(name, impl):
    """Chunked XLA path: every batched in-chunk product at the preset's precision; only the
    log-decay interval sums (unbatched products with a 0/1 matrix) stay HIGHEST. GPU kernel
    (interpret mode on CPU, 2-D tiles): every dot at the preset's precision (compiled on an
    sm_90+ GPU, TF32 precisions run as the kernels' own rounded TF32 products)."""
    policy = PRESETS[name]
    xs = random_wkv7_inputs(0, 1, 32, 1, 16, 16, policy.compute_dtype)
    fn = lambda *xs: wkv7(*xs, impl=impl, chunk_size=16, precision=policy.wkv_precision)  # noqa
    jaxpr = jax.make_jaxpr(fn)(*xs).jaxpr
    within = "wkv7_chunked" if impl == "chunked" else "wkv7_"
    got = _dot_precisions(jaxpr, within=within)
    want = (P(policy.wkv_precision),) * 2
    allowed = {want}
    compiled_gpu = impl == "pallas" and jax.default_backend() == "gpu"
    if compiled_gpu and isinstance(tf32_round.kernel_precision(
            P(policy.wkv_precision), interpret=False, wanted=None), tf32_round.RoundedTF32):
        # TF32 on sm_90+: the chunk launches round their operands themselves (`ROUNDED`), the
        # sequential ones keep the preset's precision (XLA rounds)
        want, allowed = ROUNDED, {ROUNDED, want}
    assert sum(prec == want for prec, _ in got) >= 6, (name, impl, set(got))
    if impl == "chunked":
        assert {prec for prec, batched in got if batched} == {want}, (name, set(got))
        assert {prec for prec, batched in got if not batched} == {(P.HIGHEST,) * 2}
    else:
        assert {prec for prec, _ in got} <= allowed, (name, set(got))


def test_time_mix_hands_the_policy_precision_to_wkv7(monkeypatch):
    import lwm_jax.models.rwkv7.time_mix as tm
    seen = []
    real = tm.wkv7

    def spy(*args, **kw):
        seen.append(kw["precision"])
        return real(*args, **kw)

    monkeypatch.setattr(tm, "wkv7", spy)
    from flax import nnx
    from lwm_jax import ModelConfig
    from lwm_jax.models.rwkv7 import RWKV7
    for name in ("fp32", "bf16-mixed"):
        cfg = ModelConfig(vocab_size=32, n_layer=1, n_embd=32, head_size=16)
        RWKV7(cfg, name, rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.int32))
    assert seen == ["highest", "high"]


def test_tf32x3_is_an_opt_in_wkv_precision_that_each_backend_can_run(wkv7_problem):
    """`w=tf32x3` parses; the GPU kernel lowers it as the 3xTF32 dot algorithm; the XLA
    chunked form and the CPU interpreter (no 3xTF32 on XLA:CPU) run it as HIGHEST, and the
    result matches `highest` there exactly. The Pallas case is the program compiled for a CPU
    (`platform="cpu"`: the interpreter) on any machine; on a GPU the kernel's own lowering is
    the mapping asserted first."""
    from lwm_jax.ops.wkv7.pallas import PRECISIONS as GPU_PRECISIONS
    assert parse_policy("p=f32,c=f32,w=tf32x3").wkv_precision == "tf32x3"
    assert GPU_PRECISIONS["tf32x3"] == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    xs = wkv7_problem(3, 1, 48, 2, 16)
    for impl in ("chunked", "pallas"):
        got = _dot_precisions(jax.make_jaxpr(
            lambda *x: wkv7(*x, impl=impl, chunk_size=16, precision="tf32x3",
                            platform="cpu"))(*xs).jaxpr, within="wkv7_")
        assert got and all(p == (P.HIGHEST,) * 2 for p, _ in got), (impl, set(got))
        a = wkv7(*xs, impl=impl, chunk_size=16, precision="tf32x3", platform="cpu")
        b = wkv7(*xs, impl=impl, chunk_size=16, precision="highest", platform="cpu")
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_backend_maps_exactly_the_contracts_precision_names():
    from lwm_jax.ops.wkv7 import PRECISIONS as NAMES
    from lwm_jax.ops.wkv7.pallas_gpu.op import PRECISIONS as GPU
    from lwm_jax.ops.wkv7.pallas_tpu.op import _PRECISIONS as TPU
    from lwm_jax.precision import WKV_PRECISIONS
    assert set(GPU) == set(TPU) == set(NAMES) == set(WKV_PRECISIONS)
