"""Model FLOPs per token: the count behind "model MFU", by the field's convention.

Units: FLOPs (one multiply or one add is one FLOP; a multiply-accumulate is two) per trained
token, forward and backward together. A training step of `tokens` tokens does
`model_flops_per_token(cfg, ctx_len) * tokens` model FLOPs; model MFU is that over the step
time and the devices' peak.

The convention (MaxText's `calculate_tflops_training_per_device`, RWKV-LM, PaLM appendix B):

    model FLOPs / token = 6 * P  +  3 * sum over layers of the sequence mixer's forward FLOPs

- `P` = `matmul_params(cfg)`: every parameter but the input embedding table (a lookup, no
  arithmetic); the LM head is a matmul and counts once, also when tied to the embedding.
  6 = 2 FLOPs per weight in the forward matmul, 4 in the backward (input and weight grads).
- the mixer's own arithmetic, which no parameter accounts for, times 3 for forward + backward:
  - causal attention (LLaMA, hybrid attention layers), MaxText's count: QK^T and AV are
    `2 * T * d_head * n_heads` each per token over the whole context T, halved for the causal
    mask: `2 * T * d_head * n_heads` forward per token per layer;
  - RWKV-7's WKV recurrence per head of size N (state S is N x N; FLA layout
    `S_t = diag(e^w) S + b (a^T S) + k v^T`, `o = S^T r`): decay N², `a^T S` 2N², the rank-1
    `b (a^T S)` N² multiplies + N² adds into S, `k v^T` N² + N² adds, `S^T r` 2N²: 9 N²
    forward per token per head, so `9 * n_head * N² = 9 * C * N` per layer (independent of T).
Elementwise work (norms, token shift, gates, RoPE, softmax, the WKV bonus `r k r_k`) is not
counted, as in every reference. Functions here import no jax.
"""
from __future__ import annotations

from typing import Any

TRAIN_PASSES = 3        # forward + backward (the backward does twice the forward's FLOPs)
WEIGHT_FLOPS = 2 * TRAIN_PASSES     # per parameter per token: 6


def matmul_params(cfg: Any) -> int:
    """Parameters a token's forward multiplies through: `cfg.param_count()` less the input
    embedding `V * C`, plus the head `V * C` again when it is tied to that embedding (scalars)."""
    table = cfg.vocab_size * cfg.n_embd
    tied = bool(getattr(cfg, "tie_embeddings", False))
    return cfg.param_count() - table + (table if tied else 0)


def wkv_forward_flops(cfg: Any) -> int:
    """Forward FLOPs per token of one RWKV-7 layer's WKV recurrence: `9 * n_head * N²`
    (= 9 * C * N; see the module docstring for the 9)."""
    return 9 * cfg.n_head * cfg.head_size ** 2


def causal_attention_forward_flops(q_width: int, ctx_len: int) -> int:
    """Forward FLOPs per token of one causal attention layer's QK^T and AV (MaxText):
    `4 * T * q_width / 2 = 2 * T * q_width`, q_width = n_heads * d_head, T = ctx_len."""
    return 2 * ctx_len * q_width


def rwkv7_flops_per_token(cfg: Any, ctx_len: int) -> int:
    """RWKV-7 model FLOPs per trained token: `6 * P + 3 * L * 9 * C * N`.

    `cfg`: `ModelConfig`; `ctx_len` is accepted for a common signature (WKV's cost per token
    does not depend on it). FLOPs per token (int)."""
    del ctx_len
    return WEIGHT_FLOPS * matmul_params(cfg) + TRAIN_PASSES * cfg.n_layer * wkv_forward_flops(cfg)


def llama_flops_per_token(cfg: Any, ctx_len: int) -> int:
    """LLaMA model FLOPs per trained token: `6 * P + 3 * L * 2 * T * H * D`.

    `cfg`: `LlamaConfig` (H query heads of size D; the key/value heads enter only through P);
    `ctx_len`: T, the training sequence length. FLOPs per token (int)."""
    c = cfg.resolved()
    attn = causal_attention_forward_flops(c.n_head * c.head_dim, ctx_len)
    return WEIGHT_FLOPS * matmul_params(c) + TRAIN_PASSES * c.n_layer * attn


def hybrid_flops_per_token(cfg: Any, ctx_len: int) -> int:
    """RWKV-7 / attention hybrid model FLOPs per trained token, summed by layer kind:
    `6 * P + 3 * (R * 9 * C * N + A * 2 * T * C)` for R RWKV and A attention layers (the
    attention layers have n_head = C / N query heads of size N: q_width = C).

    `cfg`: `HybridConfig`; `ctx_len`: T. FLOPs per token (int)."""
    n_attn = len(cfg.attention_layers)
    mixers = ((cfg.n_layer - n_attn) * wkv_forward_flops(cfg)
              + n_attn * causal_attention_forward_flops(cfg.n_head * cfg.head_size, ctx_len))
    return WEIGHT_FLOPS * matmul_params(cfg) + TRAIN_PASSES * mixers


def model_flops_per_token(cfg: Any, ctx_len: int) -> int:
    """The family's count for `cfg` (any registered model config) at context `ctx_len`."""
    from lwm_jax.models.registry import arch_of_config
    return arch_of_config(cfg).model_flops_per_token(cfg, ctx_len)
