"""Test helpers for RWKV-7: give every parameter a random, non-degenerate value.

At the official init `W_o = 0` and `ffn.value = 0`, so every block is the identity and tests of
state carry, scan-vs-loop or import/export would pass vacuously. `randomize_params` adds noise of
a sensible scale to every parameter (in place) so each path of the model matters.
`tiny_model`, `toy_loss_and_grads` and `run_impls` (compiled models) serve the tests that compare
a kernel knob's choices (`Runtime.*_impl`) on a whole model.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.models.rwkv7.model import RWKV7
from lwm_jax.runtime import Runtime

# [..., in, out] matrices: noise ~ N(0, 1/in); vectors: noise ~ N(0, 0.1²); emb: N(0, 1).
MATRIX_NAMES = frozenset({"receptance", "key", "value", "output", "head",
                          "w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"})


def randomize_params(model: nnx.Module, seed: int = 0, scale: float = 1.0) -> nnx.Module:
    """Add deterministic Gaussian noise to every `nnx.Param` of `model` (in place; returns it).

    Matrices named in `MATRIX_NAMES` with shape `[..., in, out]` get `scale·N(0, 1/in)`, `emb`
    gets `scale·N(0, 1)`, everything else (mixes, norms, w0, r_k, ...) `0.1·scale·N(0, 1)`.
    Noise is drawn in float64 NumPy from `seed`, rounded to float32 and added to the float32
    value of the parameter; the sum is rounded once to the parameter's dtype. That arithmetic
    runs in NumPy on the host (IEEE float32 addition and round-to-nearest-even conversion, the
    values XLA computes for the same two operations), so a new parameter shape or dtype compiles
    nothing (eager `jnp` compiles each operation once per shape: ~0.5 s per model on a CPU);
    each result goes back to its parameter's sharding.
    """
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)

    def noisy(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        if name in MATRIX_NAMES and x.ndim >= 2:
            std = scale / np.sqrt(x.shape[-2])
        elif name == "emb":
            std = scale
        else:
            std = 0.1 * scale
        noise = rng.standard_normal(x.shape) * std
        value = (np.asarray(x, np.float32) + noise.astype(np.float32)).astype(x.dtype)
        return jax.device_put(value, getattr(x, "sharding", None))

    new = jax.tree_util.tree_map_with_path(noisy, pure)
    nnx.replace_by_pure_dict(state, new)
    nnx.update(model, state)
    return model


def tiny_model(n_embd: int, head_size: int, policy: str = "bf16-mixed", **runtime):
    """A randomised two-layer RWKV-7 (vocabulary 97) with the chunked XLA WKV (chunk 16) and
    the given `Runtime` fields."""
    cfg = ModelConfig(vocab_size=97, n_layer=2, n_embd=n_embd, head_size=head_size)
    rt = Runtime(**{"wkv_impl": "chunked", "chunk_size": 16, **runtime})
    return randomize_params(RWKV7(cfg, policy, runtime=rt, rngs=nnx.Rngs(0)), seed=1)


def _toy_loss_and_grads(graphdef, params, rest, tokens_BT):
    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tokens_BT)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])
    return jax.value_and_grad(loss)(params)


@functools.partial(jax.jit, static_argnums=0)
def _all_losses_and_grads(graphdefs, params, rests, tokens_BT):
    return [_toy_loss_and_grads(g, p, r, tokens_BT) for g, p, r in zip(graphdefs, params, rests)]


def toy_losses_and_grads(models, tokens_BT) -> list:
    """`toy_loss_and_grads` of each model in `models`, all in one compiled program (`jax.jit`,
    keyed on the models' graphs). Compiled, as a train step runs a model: op by op, every
    operation would be dispatched alone and the Pallas interpreter would run its kernels one
    grid step at a time. One program for all: XLA's cost per program is paid once (on a CPU,
    three tiny RWKV-7s compile in one program in ~2/3 of the time of three programs)."""
    splits = [nnx.split(m, nnx.Param, ...) for m in models]
    graphdefs, params, rests = (list(x) for x in zip(*splits))
    return _all_losses_and_grads(tuple(graphdefs), params, rests, tokens_BT)


def toy_loss_and_grads(model: nnx.Module, tokens_BT):
    """`(loss, parameter gradients)` of a toy loss on the model's logits (mean over positions
    of logsumexp minus the first logit): every parameter gets a gradient. Compiled (see
    `toy_losses_and_grads`)."""
    return toy_losses_and_grads([model], tokens_BT)[0]


def kernel_count(model: nnx.Module, tokens_BT, kernel: str, find_eqns) -> int:
    """How many `pallas_call`s named with `kernel` the jaxpr of `toy_loss_and_grads(model,
    tokens)` holds (`find_eqns(jaxpr, primitive)`: the tests' `jaxpr_eqns` fixture). The
    jaxpr is traced from the function that `toy_loss_and_grads` compiles, so its equations are
    the model's, not one `pjit` around them."""
    split = nnx.split(model, nnx.Param, ...)
    jaxpr = jax.make_jaxpr(lambda t: _toy_loss_and_grads(*split, t))(tokens_BT)
    return sum(kernel in str(e.params.get("name", ""))
               for e in find_eqns(jaxpr.jaxpr, "pallas_call"))


def run_impls(models: dict, tokens_BT, kernel: str, find_eqns) -> dict:
    """For each named model of `models`: `(loss, grads, kernel_count)` (see
    `toy_loss_and_grads`, `kernel_count`); the losses and gradients of all of them come from
    one compiled program (`toy_losses_and_grads`)."""
    runs = toy_losses_and_grads(list(models.values()), tokens_BT)
    return {name: (*run, kernel_count(model, tokens_BT, kernel, find_eqns))
            for (name, model), run in zip(models.items(), runs)}


def param_dict(model: nnx.Module) -> dict:
    """The model's parameters as a nested dict of arrays (the documented tree)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))
