"""The RWKV-7 ("x070") language model in Flax NNX.

```python
model = RWKV7(cfg, policy, rngs=nnx.Rngs(0))                    # runtime=Runtime() default
logits_BTV = model(tokens_BT)                                   # float32 logits
logits_BTV, state = model(tokens_BT, state=None, return_state=True, segment_ids=None)
state = model.init_state(batch_size)                            # RWKV7State of zeros
logits_BTV = model.head_logits(x_BTC)       # final LayerNorm + head only (fp32 island)
model.param_count()                         # == cfg.param_count()
```

Parameter tree (`nnx.state(model, nnx.Param)`), `x @ W` layout (torch Linear weights transposed),
block parameters stacked on a leading L axis; logical axes in brackets:

    emb                      [V, C]      (vocab, embed)      uniform ±1e-4
    ln0.{weight,bias}        [C]         (embed)
    blocks.ln1.{weight,bias} [L, C]      (layers, embed)
    blocks.ln2.{weight,bias} [L, C]      (layers, embed)
    blocks.att.{x_r,x_w,x_k,x_v,x_a,x_g,w0,a0,v0,k_k,k_a}  [L, C]  (layers, embed)
    blocks.att.{w1,a1,v1,g1} [L, C, d]   (layers, embed, lora)   d = decay/a/v/gate rank
    blocks.att.{w2,a2,v2,g2} [L, d, C]   (layers, lora, embed)
    blocks.att.r_k           [L, H, N]   (layers, heads, head_dim)
    blocks.att.{receptance,key,value} [L, C, C]  (layers, embed, heads)
    blocks.att.output        [L, C, C]   (layers, heads, embed)
    blocks.att.ln_x.{weight,bias} [L, C] (layers, embed)
    blocks.ffn.x_k           [L, C]      (layers, embed)
    blocks.ffn.key           [L, C, 4C]  (layers, embed, mlp)
    blocks.ffn.value         [L, 4C, C]  (layers, mlp, embed)
    ln_out.{weight,bias}     [C]         (embed)
    head                     [C, V]      (embed, vocab)

("heads" on a C-sized axis names the flattened H·N feature axis.) Official checkpoint names map
1:1: `emb.weight` = emb, `blocks.0.ln0` = ln0, `blocks.i.att.receptance.weight` =
`blocks.att.receptance[i].T`, `blocks.i.att.x_r [1,1,C]` = `blocks.att.x_r[i]`, `head.weight` =
head.T, `blocks.i.att.w1` = `blocks.att.w1[i]` (LoRA matrices are already `x @ w` in the
official file: no transpose), and so on. Layer 0's v0/v1/v2 exist but are unused (layer 0
defines `v_first = v`); their gradient is exactly zero.

Precision: parameters in `policy.param_dtype`; the residual stream and all mixers in
`policy.compute_dtype`; the final LayerNorm and the head matmul run in float32 (logits fp32
island), then logits are cast to `policy.output_dtype` (float32 in every preset).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from lwm_jax.hardware import platform_of
from lwm_jax.models.inputs import checked_inputs
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.models.stacked import unstack
from lwm_jax.probe import scoped
from lwm_jax.models.rwkv7 import init
from lwm_jax.models.rwkv7.block import Block, LayerState, block_forward
from lwm_jax.layers.embedding import embedding_lookup
from lwm_jax.layers.layout import pin_activation
from lwm_jax.layers.norms import LayerNorm
from lwm_jax.ops.layer_norm import layer_norm
from lwm_jax.precision import Policy, matmul_outputs_saveable, parse_policy
from lwm_jax.precision.fp8 import Fp8Meta
from lwm_jax.remat_names import WKV7_OUTPUT_NAME, WKV7_RESIDUALS_NAME
from lwm_jax.runtime import Runtime


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RWKV7State:
    """Recurrent state of the whole model (all float32).

    tmix_shift: `[L, B, C]` last token's ln1 output per layer (TimeMix token shift).
    cmix_shift: `[L, B, C]` last token's ln2 output per layer (ChannelMix token shift).
    wkv: `[L, B, H, N, N]` WKV state per layer and head, indexed [key, value].
    """

    tmix_shift: jax.Array
    cmix_shift: jax.Array
    wkv: jax.Array


class RWKV7(nnx.Module):
    """RWKV-7 language model (see the module docstring for the parameter tree).

    Args:
      cfg: `ModelConfig` (zero LoRA ranks are resolved with RWKV-LM's rule; `self.cfg` holds
        the resolved copy).
      policy: `Policy` or a string accepted by `parse_policy` (e.g. "bf16-mixed").
      runtime: `Runtime` (WKV implementation, chunk, remat, layer scan); None = defaults.
        It changes how the model runs, never its math or parameter tree.
      mesh: the device mesh the model runs on, or None. With more than one device, every
        layer's WKV runs inside a `shard_map` on each device's own rows (batch over data/fsdp,
        heads over tensor); when the `sequence` axis has more than one device it runs
        sequence-parallel over it (`lwm_jax.ops.wkv7.sequence_parallel`: each device its
        contiguous slice of T, the slices' state transitions composed across devices) instead
        of on the whole sequence per device. T must then be divisible by that axis. Math and
        parameters unchanged.
      rngs: `nnx.Rngs`; the `params` stream seeds every random init.
    """

    def __init__(self, cfg: ModelConfig, policy: Policy | str, *, runtime: Runtime | None = None,
                 mesh=None, rngs: nnx.Rngs):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"RWKV7: cfg must be a lwm_jax.ModelConfig, got {type(cfg).__name__}")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise TypeError(f"RWKV7: runtime must be a lwm_jax.runtime.Runtime, got "
                            f"{type(runtime).__name__}")
        self.cfg = cfg.resolved()
        self.runtime = runtime or Runtime()
        self.policy = parse_policy(policy)
        # On any multi-device mesh the WKV runs per device inside a shard_map: a Pallas kernel
        # is a custom call XLA's partitioner cannot split, so under automatic partitioning each
        # device would gather the whole batch and run all of it.
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.platform = platform_of(mesh)      # the devices it is compiled for pick the kernels
        V, C, pd = self.cfg.vocab_size, self.cfg.n_embd, self.policy.param_dtype
        self.emb = nnx.Param(init.embedding(rngs.params(), V, C, pd),
                             logical_axes=("vocab", "embed"))
        self.ln0 = LayerNorm(C, param_dtype=pd)
        self.blocks = Block(self.cfg, self.policy, rngs=rngs)
        self.ln_out = LayerNorm(C, param_dtype=pd)
        self.head = nnx.Param(init.head(rngs.params(), C, V, pd), logical_axes=("embed", "vocab"))

    def init_state(self, batch_size: int) -> RWKV7State:
        """Zero state for `batch_size` fresh sequences."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"init_state: batch_size must be a positive integer, got "
                             f"{batch_size!r}")
        c = self.cfg
        L, C, H, N = c.n_layer, c.n_embd, c.n_head, c.head_size
        return RWKV7State(jnp.zeros((L, batch_size, C), jnp.float32),
                          jnp.zeros((L, batch_size, C), jnp.float32),
                          jnp.zeros((L, batch_size, H, N, N), jnp.float32))

    def param_count(self) -> int:
        """Number of parameter scalars (equals `ModelConfig.param_count()`)."""
        return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(self, nnx.Param)))

    def features(self, tokens_BT, segment_ids=None):
        """Final residual stream `[B, T, C]` (compute dtype), before `ln_out` and the head.

        `head_fn(self.policy)(x, self.head_params())` turns it into logits; the trainer's fused
        loss (`train.loss.fused_lm_loss`) does that chunk by chunk.
        """
        return self._trunk(tokens_BT, None, segment_ids, None)[0]

    def head_params(self):
        """`(ln_out weight, ln_out bias, head)`: the arrays `head_fn` takes."""
        return (self.ln_out.weight[...], self.ln_out.bias[...], self.head[...])

    def __call__(self, tokens_BT, state: RWKV7State | None = None, return_state: bool = False,
                 segment_ids=None, probe=None):
        """Logits for `tokens_BT` (int `[B, T]`).

        Args:
          state: `RWKV7State` carried from a previous call (None = zeros).
          return_state: also return the state after the last token.
          segment_ids: optional int `[B, T]` packed-document ids: the recurrent state (WKV and
            token shift) restarts from zero where the id changes (not at position 0).
          probe: optional `probe(name, x)` tap (`lwm_jax.probe`) called in execution
            order: `emb`, `ln0`, `layer{l}/...` for each block, `logits`. Needs a model built
            with `remat=False` and `scan_layers=False` (ValueError otherwise).
        Returns:
          logits `[B, T, V]` in `policy.output_dtype` (computed in float32), or
          `(logits, RWKV7State)` when `return_state`.
        """
        x, new = self._trunk(tokens_BT, state, segment_ids, probe)
        logits = self.head_logits(x)
        if probe is not None:
            probe("logits", logits)
        if return_state:
            return logits, RWKV7State(new.tmix_shift, new.cmix_shift, new.wkv)
        return logits

    def _trunk(self, tokens_BT, state, segment_ids, probe):
        """Embedding, ln0 and the blocks: `(x_BTC, new LayerState)`; checks the inputs."""
        tokens_BT, segment_ids = checked_inputs("RWKV7", tokens_BT, segment_ids)
        B, T = tokens_BT.shape
        if state is None:
            state = self.init_state(B)
        self._check_state(state, B)
        if probe is not None and (self.runtime.remat or self.runtime.scan_layers):
            raise ValueError("RWKV7: a probe needs a model built with remat=False and "
                             "scan_layers=False (it cannot look inside jax.checkpoint or lax.scan)")
        tap = probe or (lambda name, x: None)
        # out-of-range token ids give NaN embeddings (jnp.take's "fill" mode), hence NaN logits
        with jax.named_scope("embed"):
            x = embedding_lookup(self.emb[...], tokens_BT, self.mesh)
            tap("emb", x)
            x = layer_norm(x, self.ln0.weight[...], self.ln0.bias[...],
                           out_dtype=self.policy.compute_dtype)
        tap("ln0", x)

        # parameters and, under an FP8 policy, the GEMMs' scaling state (`Fp8Meta`): both
        # stacked over layers, both inputs of the differentiated step
        params = nnx.to_pure_dict(nnx.state(self.blocks, nnx.Any(nnx.Param, Fp8Meta)))
        states = LayerState(state.tmix_shift, state.cmix_shift, state.wkv)
        x, new = self._run_blocks(params, x, states, segment_ids, probe)

        return x, new

    def head_logits(self, x_BTC):
        """Logits fp32 island: `LN_out(x) @ head` with float32 statistics, operands and result.

        `x_BTC`: final residual stream `[B, T, C]` (any float dtype). Returns `[B, T, V]` in
        `policy.output_dtype` (float32 in every preset).
        """
        logits = head_fn(self.policy)(x_BTC, self.head_params())
        return logits.astype(self.policy.output_dtype)

    def _wkv_op(self):
        """The WKV7 function of every layer: sequence-parallel over `self.mesh`, or None
        (= `lwm_jax.ops.wkv7.wkv7` on each device's whole sequence)."""
        return None if self.mesh is None else _sequence_parallel_wkv(self.mesh)

    def _run_blocks(self, params, x_BTC, states: LayerState, segment_ids, probe=None):
        """All layers, by Python loop (layer 0 traced apart: it defines v_first) or `lax.scan`.

        The scan runs layer 0 in its body too, told apart by a traced flag (`block_forward`'s
        `first`), so one remat setting over all layers scans the stacked `[L, ...]` parameters
        and states as they are: slicing off layer 0 copied every other layer's float32
        parameters before the scan, and its gradient was a concatenation of them after it.
        """
        cfg, policy, rt = self.cfg, self.policy, self.runtime
        pin = partial(pin_activation, mesh=self.mesh)     # `layers/layout.py` says why

        def make(first, remat):
            """`first`: True / False (layer 0 / later ones), or None: a traced flag per call."""
            fn = partial(block_forward, cfg=cfg, policy=policy, runtime=rt,
                         wkv_op=self._wkv_op(), platform=self.platform, mesh=self.mesh)

            def step(p, x, v_first, st, seg, is_first=None, layer_probe=None):
                x, v_first, st = fn(p, pin(x), pin(v_first), st,
                                    first=first if first is not None else is_first,
                                    segment_ids_BT=seg, probe=layer_probe)
                return pin(x), pin(v_first), st
            return jax.checkpoint(step, policy=remat_policy(rt)) if remat else step

        if rt.scan_layers:
            runs = rt.remat_runs(0, cfg.n_layer)
            carry = (x_BTC, jnp.zeros_like(x_BTC))      # v_first: set by layer 0
            outs = []
            for start, stop, remat in runs:
                def body(carry, xs, step=make(None, remat)):
                    p, st, layer_id = xs
                    x, vf, new_st = step(p, carry[0], carry[1], st, segment_ids, layer_id == 0)
                    return (x, vf), new_st
                whole = (start, stop) == (0, cfg.n_layer)
                run = (params, states) if whole else jax.tree.map(
                    lambda a: a[start:stop], (params, states))  # noqa: B023
                carry, run_states = jax.lax.scan(body, carry, (*run, jnp.arange(start, stop)))
                outs.append(run_states)
            if len(outs) == 1:
                return carry[0], outs[0]
            return carry[0], jax.tree.map(lambda *a: jnp.concatenate(a), *outs)

        layer = lambda tree, l: jax.tree.map(lambda a: a[l], tree)  # noqa: E731
        per_layer = unstack(params, cfg.n_layer)     # one stacked gradient, not L padded ones
        v_first, outs = None, []
        for l in range(cfg.n_layer):
            x_BTC, v_first, st = make(l == 0, rt.rematerialized(l))(
                per_layer[l], x_BTC, v_first, layer(states, l), segment_ids,
                layer_probe=scoped(probe, f"layer{l}"))
            outs.append(jax.tree.map(lambda a: a[None], st))
        return x_BTC, jax.tree.map(lambda *a: jnp.concatenate(a), *outs)

    def _check_state(self, state, batch_size: int):
        if not isinstance(state, RWKV7State):
            raise TypeError(f"RWKV7: state must be an RWKV7State (model.init_state), got "
                            f"{type(state).__name__}")
        c = self.cfg
        L, C, H, N = c.n_layer, c.n_embd, c.n_head, c.head_size
        expect = {"tmix_shift": (L, batch_size, C), "cmix_shift": (L, batch_size, C),
                  "wkv": (L, batch_size, H, N, N)}
        for name, shape in expect.items():
            got = tuple(getattr(state, name).shape)
            if got != shape:
                raise ValueError(f"RWKV7: state.{name} has shape {got}, expected {shape} "
                                 f"(batch {batch_size}); build it with model.init_state")


def head_fn(policy: Policy):
    """`f(x_BTC, (ln_out weight, ln_out bias, head)) -> float32 logits`: the logits fp32 island
    (LayerNorm with float32 statistics and output, then the head matmul on float32 operands at
    the policy's matmul precision) as a pure function of its parameters."""
    @jax.named_scope("head")
    def f(x_BTC, head_params):
        weight, bias, head_CV = head_params
        xo = layer_norm(x_BTC, weight, bias, out_dtype=jnp.float32)
        return policy.einsum_f32("btc,cv->btv", xo, head_CV)
    return f


def _sequence_parallel_wkv(mesh):
    """`wkv7` with T split over `mesh`'s `sequence` axis (heads over `tensor` when it splits
    them), called like `wkv7`."""
    from lwm_jax.ops.wkv7.sequence_parallel import wkv7_sequence_parallel

    head_axis = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
    return partial(wkv7_sequence_parallel, mesh=mesh, axis="sequence", head_axis=head_axis)


def remat_policy(runtime: Runtime):
    """The `jax.checkpoint` policy of `runtime.remat_policy` (None = save nothing)."""
    if runtime.remat_policy == "full":
        return None
    return matmul_outputs_saveable(WKV7_RESIDUALS_NAME, WKV7_OUTPUT_NAME)


def probe_model_fn(cfg: ModelConfig, policy, runtime: Runtime | None = None):
    """`() -> RWKV7` for `lwm_jax.diagnostics.nonfinite.probed_forward` / `tap_stats`: the same
    math, parameter tree and WKV implementation as (`cfg`, `runtime`), with remat and layer
    scan off so that every layer's taps are recorded under their own names."""
    rt = dataclasses.replace(runtime or Runtime(), remat=False, scan_layers=False)
    return lambda: RWKV7(cfg, policy, runtime=rt, rngs=nnx.Rngs(0))
