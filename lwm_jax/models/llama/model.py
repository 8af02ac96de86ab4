"""A LLaMA-style decoder in Flax NNX, with the same public interface as `RWKV7`.

```python
model = Llama(cfg, policy, rngs=nnx.Rngs(0))          # runtime=Runtime() default
logits_BTV = model(tokens_BT)                          # float32 logits, causal
logits_BTV = model(tokens_BT, segment_ids=seg_BT)      # packed documents
cache = model.init_state(batch_size, max_len=256)      # empty KV cache
logits_BTV, cache = model(tokens_BT, state=cache, return_state=True)   # prefill / decode
x_BTC = model.features(tokens_BT)                      # final residual stream
logits = head_fn(model.policy, cfg.rms_eps)(x_BTC, model.head_params())
```

Parameter tree (`x @ W` layout, block parameters stacked on a leading L axis; logical axes):

    embed                      [V, C]        (vocab, embed)
    blocks.attn_norm.weight    [L, C]        (layers, embed)
    blocks.attn.q              [L, C, H*D]   (layers, embed, heads)
    blocks.attn.{k,v}          [L, C, K*D]   (layers, embed, heads)
    blocks.attn.o              [L, H*D, C]   (layers, heads, embed)
    blocks.mlp_norm.weight     [L, C]        (layers, embed)
    blocks.mlp.{gate,up}       [L, C, F]     (layers, embed, mlp)
    blocks.mlp.down            [L, F, C]     (layers, mlp, embed)
    norm.weight                [C]           (embed)
    head                       [C, V]        (embed, vocab)   -- absent with tie_embeddings

Hugging Face `LlamaForCausalLM` maps 1:1 (`lwm_jax.interop.hf_llama`): `q_proj.weight` of
layer i is `blocks.attn.q[i].T`, and so on.

Positions: token t of a plain sequence is at position t. With `segment_ids` (packed documents)
each document restarts at position 0 where its id starts, exactly as if it had been run alone
(its attention is confined to its own segment too), so a packed batch trains every document
the way it is later generated from. With a KV cache, row b's new tokens sit at
`cache.length[b] + t`.

Precision: parameters in `policy.param_dtype`; residual stream and projections in
`policy.compute_dtype`; norms, RoPE, attention softmax and the logits (final RMSNorm + head on
float32 operands) in float32; logits cast to `policy.output_dtype` (float32 in every preset).

Runtime: `remat`, `remat_policy` ("save_dots" keeps the outputs of the weight matmuls) and
`scan_layers` as for RWKV-7; `wkv_impl` and `chunk_size` do not apply. `mesh` only picks how the
embedding's gradient is reduced; attention has no sequence-parallel form here (a `sequence`
mesh axis is handled by XLA's sharding propagation).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from lwm_jax.probe import scoped
from lwm_jax.layers.attention import KVCache, empty_cache
from lwm_jax.layers.embedding import embedding_lookup
from lwm_jax.layers.layout import pin_activation
from lwm_jax.layers.rms_norm import RMSNorm, rms_norm
from lwm_jax.layers.rope import inv_frequencies, positions_from_segments, rope_cos_sin
from lwm_jax.hardware import platform_of
from lwm_jax.models.inputs import checked_inputs
from lwm_jax.models.llama.block import INIT_STD, Block, block_forward, normal
from lwm_jax.models.llama.config import LlamaConfig
from lwm_jax.models.stacked import unstack
from lwm_jax.precision import Policy, matmul_outputs_saveable, parse_policy
from lwm_jax.precision.fp8 import Fp8Meta
from lwm_jax.runtime import Runtime


class Llama(nnx.Module):
    """LLaMA-style decoder (see the module docstring for the parameter tree).

    Args:
      cfg: `LlamaConfig` (`self.cfg` holds the resolved copy: head_dim, ffn_hidden filled).
      policy: `Policy` or a `parse_policy` string.
      runtime: `Runtime` (remat, remat_policy, scan_layers); None = defaults.
      mesh: the device mesh, or None. Its devices' platform picks the attention kernel (splash
        on TPU, cuDNN on GPU), which runs per device on a mesh of several; the embedding's
        gradient reduction reads it too (`lwm_jax.layers.embedding`).
      rngs: `nnx.Rngs`; the `params` stream seeds the init.
    """

    def __init__(self, cfg: LlamaConfig, policy: Policy | str, *, runtime: Runtime | None = None,
                 mesh=None, rngs: nnx.Rngs):
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"Llama: cfg must be a LlamaConfig, got {type(cfg).__name__}")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise TypeError(f"Llama: runtime must be a lwm_jax.runtime.Runtime, got "
                            f"{type(runtime).__name__}")
        self.platform = platform_of(mesh)      # the devices it is compiled for pick the kernels
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.cfg = cfg.resolved()
        self.runtime = runtime or Runtime()
        self.policy = parse_policy(policy)
        V, C, pd = self.cfg.vocab_size, self.cfg.n_embd, self.policy.param_dtype
        self.embed = nnx.Param(normal(rngs.params(), (V, C), INIT_STD, pd),
                               logical_axes=("vocab", "embed"))
        self.blocks = Block(self.cfg, self.policy, rngs=rngs)
        self.norm = RMSNorm(C, param_dtype=pd, eps=self.cfg.rms_eps)
        if not self.cfg.tie_embeddings:
            self.head = nnx.Param(normal(rngs.params(), (C, V), INIT_STD, pd),
                                  logical_axes=("embed", "vocab"))

    # ------------------------------------------------------------------ interface
    def param_count(self) -> int:
        """Number of parameter scalars (equals `LlamaConfig.param_count()`)."""
        return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(self, nnx.Param)))

    def init_state(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """Empty KV cache (all layers stacked: k, v `[L, B, S, K, D]` in the compute dtype,
        length `[L, B]`) for `batch_size` rows of up to `max_len` (default `max_seq_len`)
        positions."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"init_state: batch_size must be a positive integer, got "
                             f"{batch_size!r}")
        S = self.cfg.max_seq_len if max_len is None else max_len
        if not isinstance(S, int) or isinstance(S, bool) or S < 1:
            raise ValueError(f"init_state: max_len must be a positive integer, got {S!r}")
        c = self.cfg
        return empty_cache(batch_size, S, c.n_kv_head, c.head_dim, self.policy.compute_dtype,
                           layers=(c.n_layer,))

    def features(self, tokens_BT, segment_ids=None):
        """Final residual stream `[B, T, C]` (compute dtype), before the final norm and head."""
        return self._trunk(tokens_BT, None, segment_ids, None)[0]

    def head_params(self):
        """`(final norm weight, head [C, V])` -- the embedding transposed when tied."""
        head = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        return (self.norm.weight[...], head)

    def head_logits(self, x_BTC):
        """float32 logits island on the final residual stream, cast to `policy.output_dtype`."""
        logits = head_fn(self.policy, self.cfg.rms_eps)(x_BTC, self.head_params())
        return logits.astype(self.policy.output_dtype)

    def __call__(self, tokens_BT, state: KVCache | None = None, return_state: bool = False,
                 segment_ids=None, probe=None):
        """Logits for int `tokens_BT [B, T]`.

        Args:
          state: a `KVCache` from `init_state` or a previous call (the new tokens are appended
            at each row's `length`); None = no history.
          return_state: also return the cache (with `state` None, a fresh one of
            `max_seq_len` positions is filled).
          segment_ids: optional int `[B, T]` packed-document ids (not with a cache).
          probe: optional `probe(name, x)` tap (needs remat=False, scan_layers=False).
        Returns:
          logits `[B, T, V]` in `policy.output_dtype`, or `(logits, KVCache)`.
        """
        if return_state and state is None:
            state = self.init_state(int(jnp.shape(tokens_BT)[0]))
        x, cache = self._trunk(tokens_BT, state, segment_ids, probe)
        logits = self.head_logits(x)
        if probe is not None:
            probe("logits", logits)
        return (logits, cache) if return_state else logits

    # ------------------------------------------------------------------ internals
    def _trunk(self, tokens_BT, cache, segment_ids, probe):
        if segment_ids is not None and cache is not None:
            raise ValueError("Llama: segment_ids cannot be combined with a KV cache state; "
                             "decode one document per row")
        tokens_BT, segment_ids = checked_inputs("Llama", tokens_BT, segment_ids)
        B, T = tokens_BT.shape
        if cache is not None:
            self._check_cache(cache, B)
        if probe is not None and (self.runtime.remat or self.runtime.scan_layers):
            raise ValueError("Llama: a probe needs a model built with remat=False and "
                             "scan_layers=False (it cannot look inside jax.checkpoint or lax.scan)")
        if cache is not None:
            positions = cache.length[0][:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        elif segment_ids is not None:
            positions = positions_from_segments(segment_ids)
        else:
            positions = jnp.arange(T, dtype=jnp.int32)[None]
        c = self.cfg
        cos, sin = rope_cos_sin(positions, inv_frequencies(c.head_dim, c.rope_theta,
                                                           c.rope_scaling))
        tap = probe or (lambda name, x: None)
        x = embedding_lookup(self.embed[...], tokens_BT, self.mesh).astype(
            self.policy.compute_dtype)
        tap("emb", x)
        params = nnx.to_pure_dict(nnx.state(self.blocks, nnx.Any(nnx.Param, Fp8Meta)))
        seg = None if segment_ids is None else jnp.asarray(segment_ids)
        return self._run_blocks(params, x, cos, sin, cache, seg, probe)

    def _run_blocks(self, params, x_BTC, cos, sin, cache, segment_ids, probe):
        """All L layers by Python loop or `lax.scan`, each optionally rematerialised."""
        cfg, policy, rt = self.cfg, self.policy, self.runtime
        fn = partial(block_forward, cfg=cfg, policy=policy, platform=self.platform,
                     mesh=self.mesh)
        pin = partial(pin_activation, mesh=self.mesh)     # `layers/layout.py` says why

        def plain(p, x, layer_cache, layer_probe=None):
            x, layer_cache = fn(p, pin(x), cos, sin, layer_cache, segment_ids_BT=segment_ids,
                                probe=layer_probe)
            return pin(x), layer_cache
        rematted = jax.checkpoint(plain, policy=remat_policy(rt)) if rt.remat else plain
        step_of = lambda l: rematted if rt.rematerialized(l) else plain  # noqa: E731
        if rt.scan_layers:
            caches = []
            for start, stop, _ in rt.remat_runs(0, cfg.n_layer):
                def body(x, xs, step=step_of(start)):
                    p, layer_cache = xs
                    return step(p, x, layer_cache)
                run = jax.tree.map(lambda a: a[start:stop], (params, cache))  # noqa: B023
                x_BTC, run_cache = jax.lax.scan(body, x_BTC, run)
                caches.append(run_cache)
            if cache is None:
                return x_BTC, None
            return x_BTC, jax.tree.map(lambda *a: jnp.concatenate(a), *caches)
        layer = lambda tree, l: jax.tree.map(lambda a: a[l], tree)  # noqa: E731
        per_layer = unstack(params, cfg.n_layer)     # one stacked gradient, not L padded ones
        new = []
        for l in range(cfg.n_layer):
            layer_cache = None if cache is None else layer(cache, l)
            x_BTC, layer_cache = step_of(l)(per_layer[l], x_BTC, layer_cache,
                                            scoped(probe, f"layer{l}"))
            new.append(layer_cache)
        stacked = None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *new)
        return x_BTC, stacked

    def _check_cache(self, cache, batch_size: int):
        if not isinstance(cache, KVCache):
            raise TypeError(f"Llama: state must be a KVCache (model.init_state), got "
                            f"{type(cache).__name__}")
        c = self.cfg
        want = (c.n_layer, batch_size, None, c.n_kv_head, c.head_dim)
        got = tuple(cache.k.shape)
        if len(got) != 5 or any(w is not None and w != g for w, g in zip(want, got)) or \
                tuple(cache.length.shape) != (c.n_layer, batch_size):
            raise ValueError(f"Llama: state.k has shape {got}, expected (L={c.n_layer}, "
                             f"B={batch_size}, S, K={c.n_kv_head}, D={c.head_dim}); build it "
                             "with model.init_state")


def head_fn(policy: Policy, rms_eps: float = 1e-5):
    """`f(x_BTC, (norm weight, head [C, V])) -> float32 logits`: final RMSNorm with float32
    statistics and output, then the head matmul on float32 operands at the policy's matmul
    precision, as a pure function of its parameters."""
    @jax.named_scope("head")
    def f(x_BTC, head_params):
        weight, head_CV = head_params
        xn = rms_norm(x_BTC, weight, eps=rms_eps, out_dtype=jnp.float32)
        return policy.einsum_f32("btc,cv->btv", xn, head_CV)
    return f


def loss_head(model: Llama):
    """The `head_fn` of this model (its `rms_eps`), for the trainer's fused loss."""
    return head_fn(model.policy, model.cfg.rms_eps)


def remat_policy(runtime: Runtime):
    """`jax.checkpoint` policy: "full" saves nothing; "save_dots" keeps the weight matmuls'
    outputs as `Policy.einsum` returns them (attention's own products are recomputed)."""
    if runtime.remat_policy == "full":
        return None
    return matmul_outputs_saveable()


def probe_model_fn(cfg: LlamaConfig, policy, runtime: Runtime | None = None):
    """`() -> Llama` with remat and layer scan off (every layer's taps recorded by name)."""
    rt = dataclasses.replace(runtime or Runtime(), remat=False, scan_layers=False)
    return lambda: Llama(cfg, policy, runtime=rt, rngs=nnx.Rngs(0))
