"""RWKV-7 model: float64 reference parity, state carry, presets, scan/loop/remat, param tree."""
from __future__ import annotations

import contextlib
import io

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lwm_jax.runtime import Runtime
from lwm_jax import PRESETS, ModelConfig
from lwm_jax.models.rwkv7 import RWKV7, RWKV7State
from lwm_jax.models.rwkv7.reference import forward_np
from lwm_jax.models.rwkv7.testing import param_dict, randomize_params

LOGICAL_AXES = {"vocab", "embed", "heads", "head_dim", "mlp", "lora", "layers"}


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def small_cfg(**kw):
    return ModelConfig(**{**dict(vocab_size=97, n_layer=3, n_embd=32, head_size=16), **kw})


def small_rt(**kw):
    return Runtime(**{**dict(chunk_size=16, wkv_impl="chunked"), **kw})


def make(cfg, policy="fp32", seed=0, scale=1.0, rt=None):
    return randomize_params(RWKV7(cfg, policy, runtime=rt or small_rt(), rngs=nnx.Rngs(seed)),
                            seed=seed + 1, scale=scale)


def tokens(B, T, V, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


def state_np(st: RWKV7State) -> dict:
    return {"tmix_shift": st.tmix_shift, "cmix_shift": st.cmix_shift, "wkv": st.wkv}


def test_matches_float64_reference_with_packed_documents():
    cfg = small_cfg()
    model = make(cfg)
    tok = tokens(2, 37, cfg.vocab_size)
    seg = jnp.asarray([[0] * 11 + [1] * 26, [4] * 37], jnp.int32)
    logits, st = model(tok, return_state=True, segment_ids=seg)
    ref, ref_state = forward_np(param_dict(model), tok, head_size=cfg.head_size, segment_ids=seg)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 37, cfg.vocab_size)
    assert rel(logits, ref) <= 1e-5
    for name, value in state_np(st).items():
        assert value.dtype == jnp.float32
        assert rel(value, ref_state[name]) <= 1e-5, name
    # the second document of row 0 behaves exactly like a fresh sequence
    alone, _ = forward_np(param_dict(model), tok[:1, 11:], head_size=cfg.head_size)
    assert rel(logits[:1, 11:], alone) <= 1e-5


@pytest.mark.parametrize("impl,scan", [("chunked", False), ("recurrent", True)])
def test_split_sequence_state_carry_equals_one_pass(impl, scan):
    cfg = small_cfg()
    model = make(cfg, rt=small_rt(wkv_impl=impl, scan_layers=scan))
    tok = tokens(2, 37, cfg.vocab_size, seed=3)
    full, full_state = model(tok, return_state=True)
    first, mid = model(tok[:, :20], return_state=True)
    second, end_state = model(tok[:, 20:], state=mid, return_state=True)
    assert rel(jnp.concatenate([first, second], axis=1), full) <= 1e-5
    for name in ("tmix_shift", "cmix_shift", "wkv"):
        assert rel(getattr(end_state, name), getattr(full_state, name)) <= 1e-5, name
    # the carried state matters: starting the second half from zeros is far off
    assert rel(model(tok[:, 20:]), full[:, 20:]) > 1e-2


@nnx.jit
def loss_and_grads(model, tok):
    """Mean next-token cross-entropy, logits and parameter gradients (one compile per config)."""
    def loss_fn(m):
        logits = m(tok[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()
        return loss, logits
    return nnx.value_and_grad(loss_fn, has_aux=True)(model)


# Error of (logits, all gradients) vs the fp32 model with the same parameters, by compute dtype,
# for parameters randomized at scale 0.3 (observed: f16 6e-4 / 4e-3, bf16 4e-3 / 2.4e-2; at
# scale 1 the random net is chaotic and bf16 errors grow to 3% / 15%).
_GRAD_SCALE = 0.3
_PRESET_TOL = {jnp.dtype(jnp.float32): (1e-6, 1e-5), jnp.dtype(jnp.float16): (3e-3, 1.5e-2),
               jnp.dtype(jnp.bfloat16): (1.5e-2, 8e-2)}
_GRAD_TOKENS = tokens(2, 17, 97, seed=5)
# float32 storage with TF32 products (10-bit mantissas, ~5e-4 per rounding): `fp32-fast` on a
# GPU. The float64 comparison then measures TF32, not float32.
_TF32_TOL = (2e-3, 5e-3)
# FP8 block GEMMs (fp8-mixed): e4m3 operands (3 mantissa bits, 2^-4 relative rounding) in the
# forward, e5m2 output gradients (2 bits) in the backward, at a fresh model's first-step
# scales; the rest of the model is bf16-mixed's
_FP8_TOL = (5e-2, 2.5e-1)


def flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


@pytest.fixture(scope="module")
def fp32_run():
    model = make(small_cfg(), "fp32", scale=_GRAD_SCALE)
    (loss, logits), grads = loss_and_grads(model, _GRAD_TOKENS)
    return model, logits, nnx.to_pure_dict(nnx.state(grads))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_forward_backward(preset, fp32_run):
    _, logits32, grads32 = fp32_run
    policy = PRESETS[preset]
    model = make(small_cfg(), policy, scale=_GRAD_SCALE)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {jnp.dtype(p.dtype) for p in params} == {jnp.dtype(policy.param_dtype)}
    (loss, logits), grads = loss_and_grads(model, _GRAD_TOKENS)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
    assert bool(jnp.isfinite(loss))
    grad_leaves = jax.tree.leaves(nnx.state(grads))
    assert len(grad_leaves) == len(params)
    for g in grad_leaves:
        assert jnp.dtype(g.dtype) == jnp.dtype(policy.param_dtype)
        assert bool(jnp.all(jnp.isfinite(g)))
    assert sum(float(jnp.sum(jnp.abs(g.astype(jnp.float32)))) for g in grad_leaves) > 0
    logits_tol, grads_tol = _PRESET_TOL[jnp.dtype(policy.compute_dtype)]
    if (jax.default_backend() == "gpu" and jnp.dtype(policy.compute_dtype) == jnp.float32
            and policy.matmul_precision == "default"):
        logits_tol, grads_tol = _TF32_TOL      # fp32-fast: TF32 products on a GPU, by design
    if policy.fp8:
        logits_tol, grads_tol = _FP8_TOL
    g = flat(nnx.to_pure_dict(nnx.state(grads)))
    if jnp.dtype(policy.compute_dtype) != jnp.float32:
        assert rel(logits, logits32) <= logits_tol
        assert rel(g, flat(grads32)) <= grads_tol
        if policy.fp8:      # FP8 is less exact than bf16: a GEMM left in bf16 fails here
            bf16_tol = _PRESET_TOL[jnp.dtype(jnp.bfloat16)]
            assert rel(logits, logits32) > bf16_tol[0] / 8, rel(logits, logits32)
        return
    # An fp32-compute preset against the fp32 run is the model against itself (0 by
    # construction on CPU): check it against float64 instead, the logits against the reference
    # forward and the gradient against central differences of the float64 loss along its own
    # direction and two random ones.
    params = param_dict(model)
    ref_logits, _ = forward_np(params, _GRAD_TOKENS[:, :-1], head_size=16)
    assert rel(logits, ref_logits) <= logits_tol
    rng = np.random.default_rng(7)
    for u in (g, rng.standard_normal(g.size), rng.standard_normal(g.size)):
        u = u / np.linalg.norm(u)
        eps = 1e-5
        fd = (_loss64(params, u * eps) - _loss64(params, -u * eps)) / (2 * eps)
        assert abs(float(g @ u) - fd) <= grads_tol * np.linalg.norm(g), (
            f"gradient along a direction: {float(g @ u):.7g}, float64 central difference "
            f"{fd:.7g} (|g| = {np.linalg.norm(g):.4g})")


def _loss64(params, delta):
    """Float64 mean next-token cross-entropy of `params + delta` (delta: flat, as `flat`)."""
    leaves, treedef = jax.tree.flatten(params)
    moved, at = [], 0
    for x in leaves:
        moved.append(np.asarray(x, np.float64) + delta[at: at + x.size].reshape(x.shape))
        at += x.size
    tok = np.asarray(_GRAD_TOKENS)
    z, _ = forward_np(jax.tree.unflatten(treedef, moved), tok[:, :-1], head_size=16)
    top = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(-1)) + top[..., 0]
    return float(np.mean(lse - np.take_along_axis(z, tok[:, 1:, None], -1)[..., 0]))


@pytest.mark.parametrize("scan,policy,layers", [(True, "full", -1), (True, "save_dots", -1),
                                                 (False, "save_dots", -1),
                                                 (True, "save_dots", 1), (False, "full", 1)])
def test_scan_with_remat_equals_python_loop(fp32_run, scan, policy, layers):
    """Python loop without remat (fixture) vs `jax.checkpoint` under each remat policy, with
    and without `lax.scan`, on every block or the first `remat_layers` (a scan per run of
    blocks): same tree, values, logits and gradients. (Scan without remat is exercised by the
    state-carry test.)"""
    loop_model, loop_logits, loop_grads = fp32_run
    loop_params = param_dict(loop_model)
    model = make(small_cfg(), scale=_GRAD_SCALE,
                 rt=small_rt(scan_layers=scan, remat=True, remat_policy=policy,
                             remat_layers=layers))
    (loss, logits), grads = loss_and_grads(model, _GRAD_TOKENS)
    params, grads = param_dict(model), nnx.to_pure_dict(nnx.state(grads))
    assert jax.tree.structure(params) == jax.tree.structure(loop_params)
    assert all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.tree.leaves(params), jax.tree.leaves(loop_params)))
    assert rel(logits, loop_logits) <= 1e-6
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(loop_grads)):
        if float(jnp.linalg.norm(g0)) > 0:
            assert rel(g, g0) <= 1e-5
        else:  # layer 0's unused v0/v1/v2 get exactly zero gradient on every path
            assert float(jnp.linalg.norm(g)) == 0.0


def _eqns(jaxpr):
    """Every equation of a jaxpr, nested ones (scan bodies, remat) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("layers,scans", [(-1, [3]), (2, [2, 1])])
def test_layer_scan_takes_the_parameter_stacks_whole(layers, scans):
    """With one remat setting over all layers the scan runs all L layers (layer 0 included)
    over the stacked parameters as they are: no slice of a `[L, ...]` stack before it, no
    concatenation of the `[L, ...]` gradient after it (each a pass over every float32
    parameter of the model per step). Two remat runs still slice at their boundary."""
    cfg = small_cfg()
    model = make(cfg, rt=small_rt(scan_layers=True, remat=True, remat_layers=layers))
    graphdef, params = nnx.split(model)
    tok = tokens(1, 17, cfg.vocab_size)
    loss = lambda p: nnx.merge(graphdef, p)(tok).sum()  # noqa: E731
    eqns = list(_eqns(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))
    L, C = cfg.n_layer, cfg.n_embd
    layer_scans = [e.params["length"] for e in eqns if e.primitive.name == "scan"
                   and any(getattr(v.aval, "shape", ())[1:] == (C, C) for v in e.invars)]
    assert layer_scans[:len(scans)] == scans       # the forward's; the backward's follow
    stack_ops = [e for e in eqns if e.primitive.name in ("slice", "concatenate")
                 and any(getattr(v.aval, "shape", ())[:1] in ((L,), (L - 1,))
                         and getattr(v.aval, "shape", ())[1:] == (C, C)
                         for v in [*e.invars, *e.outvars])]
    if layers == -1:
        assert stack_ops == []
    else:
        assert stack_ops


def _saved_for_backward(model) -> list[str]:
    """`jax.ad_checkpoint.print_saved_residuals` lines of the model's loss gradient."""
    graphdef, params = nnx.split(model)
    tok = tokens(1, 33, model.cfg.vocab_size)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    return buf.getvalue().splitlines()


@pytest.mark.parametrize("impl", ["pallas", "chunked"])
def test_save_dots_keeps_matmul_and_wkv_kernel_outputs(impl):
    """`remat_policy="save_dots"` keeps each layer's WKV output (every implementation) and,
    for the Pallas kernel, the kernel's named saved-for-backward arrays, plus the matmul
    outputs: on the GPU this is what stops the backward from running each forward kernel
    twice (H200 profile: `wkv7_intra_fwd` 2 -> 1 launch per layer and step). The matmul
    outputs are kept as `Policy.einsum` returns them, bfloat16 under `bf16-mixed` (float32
    only for the decay island's `einsum_f32`), never as the float32 accumulator (XLA's
    dot-output policy kept that: twice the bytes). `full` keeps none of them."""
    cfg = small_cfg(n_layer=2)
    saved = {}
    for policy in ("full", "save_dots"):
        rt = Runtime(wkv_impl=impl, chunk_size=16, remat=True, remat_policy=policy)
        saved[policy] = _saved_for_backward(RWKV7(cfg, "bf16-mixed", runtime=rt,
                                                  rngs=nnx.Rngs(0)))
    count = lambda lines, what: sum(what in line for line in lines)  # noqa: E731
    assert count(saved["save_dots"], "named 'wkv7_out'") == cfg.n_layer
    matmuls = [line for line in saved["save_dots"] if "named 'policy_matmul'" in line]
    assert len(matmuls) >= 6 * cfg.n_layer
    assert not any("output of dot_general" in line for line in saved["save_dots"])
    wide = [line for line in matmuls if not line.startswith("bf16")]
    assert wide and all("einsum_f32" in line for line in wide), wide
    kernel = count(saved["save_dots"], "named 'wkv7_residuals'")
    assert kernel == (4 * cfg.n_layer if impl == "pallas" else 0)
    assert not any("named 'wkv7" in line or "output of dot_general" in line
                   for line in saved["full"])
    # full keeps only the blocks' inputs; one is a matmul output: layer 0's value (v_first)
    assert count(saved["full"], "named 'policy_matmul'") == 1


def test_remat_layers_rematerializes_only_the_first_blocks():
    """`remat_layers=k` wraps blocks 0..k-1 in `jax.checkpoint` and leaves the rest as without
    remat: the saved-for-backward set grows with every unrematerialised block, k = 0 saves
    what no remat saves, and k = L (or -1) what remat on every block saves."""
    cfg = small_cfg(n_layer=3)

    def saved(**kw):
        rt = Runtime(wkv_impl="chunked", chunk_size=16, **kw)
        return _saved_for_backward(RWKV7(cfg, "bf16-mixed", runtime=rt, rngs=nnx.Rngs(0)))
    none, every = saved(remat=False), saved(remat=True)
    by_k = [saved(remat=True, remat_layers=k) for k in range(cfg.n_layer + 1)]
    assert by_k[0] == none and by_k[cfg.n_layer] == every
    assert len(none) > len(by_k[1]) > len(by_k[2]) > len(every)
    assert Runtime(remat=True, remat_layers=2).rematerialized(1)
    assert not Runtime(remat=True, remat_layers=2).rematerialized(2)
    assert not Runtime(remat=False, remat_layers=-1).rematerialized(0)
    assert Runtime(remat=True, remat_layers=2).remat_runs(1, 4) == [(1, 2, True), (2, 4, False)]
    assert Runtime(remat=True).remat_runs(0, 3) == [(0, 3, True)]
    assert Runtime(remat=True, remat_layers=0).remat_runs(1, 3) == [(1, 3, False)]


def test_param_count_of_0p1b_config_from_module_shapes():
    cfg = ModelConfig(vocab_size=65536, n_layer=12, n_embd=768, head_size=64)
    abstract = nnx.eval_shape(lambda: RWKV7(cfg, "bf16-mixed", rngs=nnx.Rngs(0)))
    assert abstract.param_count() == 191_084_544 == cfg.param_count()
    lora = abstract.blocks.att
    assert (lora.w1.shape[-1], lora.a1.shape[-1], lora.v1.shape[-1], lora.g1.shape[-1]) == \
        (64, 64, 32, 128)


def test_parameter_tree_names_and_shapes():
    cfg = ModelConfig(vocab_size=50, n_layer=2, n_embd=32, head_size=8, decay_lora=8, a_lora=16,
                      v_lora=24, gate_lora=40)
    model = nnx.eval_shape(lambda: RWKV7(cfg, "fp32", rngs=nnx.Rngs(0)))
    shapes = jax.tree.map(lambda x: tuple(x.shape), param_dict(model))
    L, C, V, H, N, F = 2, 32, 50, 4, 8, 128
    att = {n: (L, C) for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0",
                               "k_k", "k_a")}
    for first, second, d in (("w1", "w2", 8), ("a1", "a2", 16), ("v1", "v2", 24),
                             ("g1", "g2", 40)):
        att[first], att[second] = (L, C, d), (L, d, C)
    att.update(r_k=(L, H, N), receptance=(L, C, C), key=(L, C, C), value=(L, C, C),
               output=(L, C, C), ln_x={"weight": (L, C), "bias": (L, C)})
    norm = {"weight": (C,), "bias": (C,)}
    expected = {
        "emb": (V, C), "ln0": norm, "ln_out": norm, "head": (C, V),
        "blocks": {"ln1": {"weight": (L, C), "bias": (L, C)},
                   "ln2": {"weight": (L, C), "bias": (L, C)}, "att": att,
                   "ffn": {"x_k": (L, C), "key": (L, C, F), "value": (L, F, C)}},
    }
    assert shapes == expected
    assert model.param_count() == cfg.param_count()


def test_logical_axes_on_every_param():
    model = nnx.eval_shape(lambda: RWKV7(small_cfg(), "fp32", rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert len(flat) == 39
    for path, var in flat:
        axes = var.get_metadata().get("logical_axes")
        assert isinstance(axes, tuple) and len(axes) == len(var.shape), path
        assert set(axes) <= LOGICAL_AXES and len(set(axes)) == len(axes), (path, axes)
        assert (axes[0] == "layers") == (path[0] == "blocks"), (path, axes)


def test_state_is_a_pytree_and_bad_inputs_raise():
    cfg = small_cfg()
    model = RWKV7(cfg, "fp32", rngs=nnx.Rngs(0))
    st = model.init_state(3)
    assert [x.shape for x in jax.tree.leaves(st)] == [(3, 3, 32), (3, 3, 32), (3, 3, 2, 16, 16)]
    assert all(float(jnp.abs(x).sum()) == 0 and x.dtype == jnp.float32
               for x in jax.tree.leaves(st))
    tok = tokens(3, 4, cfg.vocab_size)
    with pytest.raises(ValueError, match="tokens"):
        model(tok.astype(jnp.float32))
    with pytest.raises(ValueError, match="tokens"):
        model(tok[0])
    with pytest.raises(ValueError, match="state.tmix_shift"):
        model(tok[:2], state=st)
    with pytest.raises(TypeError, match="RWKV7State"):
        model(tok, state=state_np(st))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tok, segment_ids=jnp.zeros((3, 5), jnp.int32))
    with pytest.raises(ValueError, match="batch_size"):
        model.init_state(0)
    with pytest.raises(TypeError, match="ModelConfig"):
        RWKV7({"n_layer": 2}, "fp32", rngs=nnx.Rngs(0))
