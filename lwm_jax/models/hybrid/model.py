"""RWKV-7 with attention layers at chosen depths, in Flax NNX (`arch: rwkv7-hybrid`).

```python
model = RWKVHybrid(HybridConfig(n_layer=12, attention_layers=(5, 11)), "bf16-mixed",
                   rngs=nnx.Rngs(0))
logits_BTV = model(tokens_BT, segment_ids=None)      # float32 logits
```

Layer `l` is an RWKV-7 block (`lwm_jax.models.rwkv7.block.block_forward`: TimeMix, ChannelMix)
unless `l` is in `cfg.attention_layers`, where TimeMix is replaced by causal grouped-query
attention with RoPE (`lwm_jax.models.llama.block.attention_forward`: q/k/v/o projections,
float32 RoPE, float32 softmax) and the layer keeps RWKV's LayerNorms and ChannelMix:

    x += Attention(LN1(x));  x += ChannelMix(LN2(x))

Parameter tree: RWKV7's (`emb`, `ln0`, `blocks.*` stacked over the R = L - A RWKV layers in
depth order, `ln_out`, `head`) plus `attn_blocks.{ln1, ln2}` `[A, C]`, `attn_blocks.attn.{q, k,
v, o}` (`[A, C, H·N]`, `[A, C, K·N]`, `[A, H·N, C]`) and `attn_blocks.ffn` (ChannelMix `[A, ...]`).
The RWKV layers' vector parameters get the official init of their real depth in the L-layer
stack (as in an L-layer RWKV-7); attention projections get N(0, 0.02²) (`o`: 0.02 / sqrt(2A)).

Packed documents (`segment_ids`): RWKV layers restart their state where the id changes, the
attention layers attend within a document, and RoPE positions restart at each document.

Runs layers by a Python loop (each layer under `jax.checkpoint` when `runtime.remat`); the
`scan_layers` switch does not apply. Not supported yet, each refused in one line: carried
recurrent state and generation (the attention layers would need a KV cache beside the RWKV
state), and sequence parallelism (the attention layers would need ring attention).
"""
from __future__ import annotations

import dataclasses
import math
import types
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.probe import scoped
from lwm_jax.layers.embedding import embedding_lookup
from lwm_jax.layers.layout import pin_activation
from lwm_jax.layers.norms import LayerNorm
from lwm_jax.layers.rope import inv_frequencies, positions_from_segments, rope_cos_sin
from lwm_jax.models.hybrid.config import HybridConfig
from lwm_jax.hardware import platform_of
from lwm_jax.models.inputs import checked_inputs
from lwm_jax.models.llama.block import Attention, attention_forward
from lwm_jax.models.rwkv7 import init
from lwm_jax.models.rwkv7.block import Block, LayerState, block_forward
from lwm_jax.models.rwkv7.channel_mix import ChannelMix, channel_mix_forward
from lwm_jax.models.rwkv7.model import _sequence_parallel_wkv, head_fn, remat_policy
from lwm_jax.models.stacked import unstack
from lwm_jax.ops.layer_norm import layer_norm
from lwm_jax.precision import Policy, parse_policy
from lwm_jax.precision.fp8 import Fp8Meta
from lwm_jax.runtime import Runtime

__all__ = ["RWKVHybrid", "head_fn", "probe_model_fn"]


def _attention_shape(cfg: HybridConfig, n_layer: int):
    """The fields `llama.block.Attention` / `attention_forward` read."""
    return types.SimpleNamespace(n_layer=n_layer, n_embd=cfg.n_embd, head_dim=cfg.head_size,
                                 n_head=cfg.n_head, n_kv_head=cfg.kv_heads)


class AttentionBlocks(nnx.Module):
    """Parameters of the A attention layers: `ln1`, `ln2` (LayerNorm `[A, C]`), `attn`
    (q/k/v/o), `ffn` (ChannelMix)."""

    def __init__(self, cfg: HybridConfig, policy: Policy, *, rngs: nnx.Rngs):
        A, pd = len(cfg.attention_layers), policy.param_dtype
        self.ln1 = LayerNorm(cfg.n_embd, param_dtype=pd, stack=(A,))
        self.ln2 = LayerNorm(cfg.n_embd, param_dtype=pd, stack=(A,))
        self.attn = Attention(_attention_shape(cfg, A), policy, rngs=rngs)
        self.ffn = ChannelMix(dataclasses.replace(_rwkv_config(cfg), n_layer=A), policy,
                              rngs=rngs)


def _rwkv_config(cfg: HybridConfig):
    from lwm_jax.models.rwkv7.config import ModelConfig
    return ModelConfig(**{f.name: getattr(cfg, f.name)
                          for f in dataclasses.fields(ModelConfig)})


def _depth_vectors(fn, layers: tuple[int, ...], n_layer: int, *args) -> dict[str, np.ndarray]:
    """`fn(l, n_layer, *args)` stacked over the given depths (the official per-layer init)."""
    per_layer = [fn(l, n_layer, *args) for l in layers]
    return {k: np.stack([d[k] for d in per_layer]) for k in per_layer[0]}


class RWKVHybrid(nnx.Module):
    """RWKV-7 / attention hybrid (see the module docstring).

    Args:
      cfg: `HybridConfig` (`self.cfg` holds the resolved copy).
      policy: `Policy` or preset string.
      runtime: `Runtime` (WKV implementation, chunk, remat); None = defaults.
      mesh: the device mesh, or None. With more than one device the RWKV layers' WKV runs
        per device inside a `shard_map` (as in `RWKV7`); a mesh whose `sequence` axis has more
        than one device is refused.
      rngs: `nnx.Rngs`.
    """

    def __init__(self, cfg: HybridConfig, policy: Policy | str, *,
                 runtime: Runtime | None = None, mesh=None, rngs: nnx.Rngs):
        if not isinstance(cfg, HybridConfig):
            raise TypeError(f"RWKVHybrid: cfg must be a HybridConfig, got {type(cfg).__name__}")
        if mesh is not None and mesh.shape.get("sequence", 1) > 1:
            raise ValueError("mesh.sequence: a hybrid model cannot shard the sequence yet (its "
                             "attention layers have no ring attention); set mesh.sequence=1")
        self.platform = platform_of(mesh)      # the devices it is compiled for pick the kernels
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.cfg = cfg.resolved()
        self.runtime = runtime or Runtime()
        self.policy = parse_policy(policy)
        c, pd = self.cfg, self.policy.param_dtype
        rwkv_cfg = dataclasses.replace(_rwkv_config(c), n_layer=len(c.rwkv_layers))
        self.emb = nnx.Param(init.embedding(rngs.params(), c.vocab_size, c.n_embd, pd),
                             logical_axes=("vocab", "embed"))
        self.ln0 = LayerNorm(c.n_embd, param_dtype=pd)
        self.blocks = Block(rwkv_cfg, self.policy, rngs=rngs)
        self._init_at_depth(self.blocks, c.rwkv_layers)
        if c.attention_layers:
            self.attn_blocks = AttentionBlocks(c, self.policy, rngs=rngs)
            self._init_at_depth(self.attn_blocks, c.attention_layers)
        self.ln_out = LayerNorm(c.n_embd, param_dtype=pd)
        self.head = nnx.Param(init.head(rngs.params(), c.n_embd, c.vocab_size, pd),
                              logical_axes=("embed", "vocab"))

    def _init_at_depth(self, blocks, layers: tuple[int, ...]):
        """Give the stacked layers the official vector init of their depth in the L stack."""
        c, pd = self.cfg, self.policy.param_dtype
        cmix = _depth_vectors(init.channel_mix_vectors, layers, c.n_layer, c.n_embd)
        blocks.ffn.x_k[...] = jnp.asarray(cmix["x_k"], pd)
        if not isinstance(blocks, Block):
            return
        tmix = _depth_vectors(init.time_mix_vectors, layers, c.n_layer, c.n_embd, c.head_size)
        att = blocks.att
        for name, value in tmix.items():
            target = att.ln_x.weight if name == "ln_x_weight" else getattr(att, name)
            target[...] = jnp.asarray(value, pd)

    def init_state(self, batch_size: int, *args, **kwargs):
        raise ValueError("generation: a hybrid (rwkv7-hybrid) model has no recurrent state "
                         "support yet (its attention layers need a KV cache); use it for "
                         "training and full-sequence scoring")

    def param_count(self) -> int:
        """Number of parameter scalars (equals `HybridConfig.param_count()`)."""
        return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(self, nnx.Param)))

    def head_params(self):
        """`(ln_out weight, ln_out bias, head)`: the arrays `head_fn` takes."""
        return (self.ln_out.weight[...], self.ln_out.bias[...], self.head[...])

    def features(self, tokens_BT, segment_ids=None):
        """Final residual stream `[B, T, C]` (compute dtype), before `ln_out` and the head."""
        return self._trunk(tokens_BT, segment_ids, None)

    def __call__(self, tokens_BT, state=None, return_state: bool = False, segment_ids=None,
                 probe=None):
        """float32 logits `[B, T, V]` of a whole sequence (no carried state)."""
        if state is not None or return_state:
            self.init_state(1)                       # raises the one-line message
        x = self._trunk(tokens_BT, segment_ids, probe)
        logits = head_fn(self.policy)(x, self.head_params())
        if probe is not None:
            probe("logits", logits)
        return logits.astype(self.policy.output_dtype)

    def _trunk(self, tokens_BT, segment_ids, probe):
        tokens_BT, segment_ids = checked_inputs("RWKVHybrid", tokens_BT, segment_ids)
        B, T = tokens_BT.shape
        if probe is not None and self.runtime.remat:
            raise ValueError("RWKVHybrid: a probe needs a model built with remat=False")
        c, policy, rt = self.cfg, self.policy, self.runtime
        tap = probe or (lambda name, x: None)
        x = embedding_lookup(self.emb[...], tokens_BT, self.mesh)
        tap("emb", x)
        x = layer_norm(x, self.ln0.weight[...], self.ln0.bias[...], out_dtype=policy.compute_dtype)
        tap("ln0", x)
        positions = (jnp.arange(T, dtype=jnp.int32)[None] if segment_ids is None
                     else positions_from_segments(segment_ids))
        cos, sin = rope_cos_sin(positions, inv_frequencies(c.head_size, c.rope_theta))
        rwkv_p = nnx.to_pure_dict(nnx.state(self.blocks, nnx.Any(nnx.Param, Fp8Meta)))
        attn_p = (nnx.to_pure_dict(nnx.state(self.attn_blocks, nnx.Any(nnx.Param, Fp8Meta)))
                  if c.attention_layers else None)
        H, N = c.n_head, c.head_size
        zero = LayerState(jnp.zeros((B, c.n_embd), jnp.float32),
                          jnp.zeros((B, c.n_embd), jnp.float32),
                          jnp.zeros((B, H, N, N), jnp.float32))
        shape = _attention_shape(c, len(c.attention_layers))

        wkv_op = None if self.mesh is None else _sequence_parallel_wkv(self.mesh)

        pin = partial(pin_activation, mesh=self.mesh)     # `layers/layout.py` says why

        def rwkv_layer(p, x, v_first, seg, first, layer_probe=None):
            x, v_first, _ = block_forward(p, pin(x), pin(v_first), zero, first=first, cfg=c,
                                          policy=policy, runtime=rt, segment_ids_BT=seg,
                                          probe=layer_probe, wkv_op=wkv_op,
                                          platform=self.platform, mesh=self.mesh)
            return pin(x), pin(v_first)

        def attention_layer(p, x, seg, layer_probe=None):
            cd = policy.compute_dtype
            x = pin(x)
            xn = layer_norm(x, p["ln1"]["weight"], p["ln1"]["bias"], out_dtype=cd)
            att, _ = attention_forward(p["attn"], xn, cos, sin, None, cfg=shape, policy=policy,
                                       segment_ids_BT=seg, platform=self.platform,
                                       mesh=self.mesh)
            x = x + att
            if layer_probe is not None:
                layer_probe("x_att", x)
            xn2 = layer_norm(x, p["ln2"]["weight"], p["ln2"]["bias"], out_dtype=cd)
            x = x + channel_mix_forward(p["ffn"], xn2, zero.cmix_shift, policy=policy,
                                        segment_ids_BT=seg, probe=scoped(layer_probe, "ffn"),
                                        platform=self.platform, mesh=self.mesh)
            if layer_probe is not None:
                layer_probe("x_out", x)
            return pin(x)

        checkpoint = lambda f, **kw: jax.checkpoint(f, policy=remat_policy(rt), **kw)  # noqa
        rematted = {False: (rwkv_layer, attention_layer),
                    True: (checkpoint(rwkv_layer, static_argnums=(4,)),
                           checkpoint(attention_layer))}
        rwkv_layers = unstack(rwkv_p, c.n_layer - len(c.attention_layers))
        attn_layers = unstack(attn_p, len(c.attention_layers)) if c.attention_layers else []
        v_first, r, a = None, 0, 0
        for l in range(c.n_layer):
            layer_probe = scoped(probe, f"layer{l}")
            rwkv_step, attention_step = rematted[rt.rematerialized(l)]
            if l in c.attention_layers:
                x = attention_step(attn_layers[a], x, segment_ids, layer_probe)
                a += 1
            else:
                x, v_first = rwkv_step(rwkv_layers[r], x, v_first, segment_ids, l == 0,
                                       layer_probe)
                r += 1
        return x


def probe_model_fn(cfg: HybridConfig, policy, runtime: Runtime | None = None):
    """`() -> RWKVHybrid` with remat off, for the non-finite localiser's taps."""
    rt = dataclasses.replace(runtime or Runtime(), remat=False, scan_layers=False)
    return lambda: RWKVHybrid(cfg, policy, runtime=rt, rngs=nnx.Rngs(0))
