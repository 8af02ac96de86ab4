"""Configuration of an RWKV-7 / attention hybrid: an RWKV-7 `ModelConfig` plus the layers that
are attention layers and their attention shape."""
from __future__ import annotations

import dataclasses

from lwm_jax.models.rwkv7.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """RWKV-7 with attention at the layers listed in `attention_layers`.

    Every field of `ModelConfig` keeps its meaning (vocabulary, depth `n_layer` counting both
    kinds of layer, width, RWKV head size and low-rank sizes, ChannelMix width). Added:

    attention_layers: 0-based layer indices whose TimeMix is replaced by causal grouped-query
      attention with RoPE (the layer keeps its LayerNorms and ChannelMix). Layer 0 must stay an
      RWKV layer: it defines the value residual (`v_first`) every later RWKV layer mixes in.
      Empty = a plain RWKV-7 stack.
    attn_kv_heads: key/value heads of the attention layers (0 = as many as query heads); the
      query heads are `n_embd / head_size` of size `head_size`, as the RWKV heads.
    rope_theta: RoPE base of the attention layers (angles in float32, `lwm_jax.layers.rope`).
    """

    attention_layers: tuple[int, ...] = ()
    attn_kv_heads: int = 0
    rope_theta: float = 10000.0

    def __post_init__(self):
        super().__post_init__()
        layers = self.attention_layers
        if not isinstance(layers, tuple) or not all(
                isinstance(l, int) and not isinstance(l, bool) for l in layers):
            raise ValueError(f"model.attention_layers: expected a list of layer indices, got "
                             f"{layers!r}")
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"model.attention_layers: {list(layers)} must be increasing with no "
                             "repeats")
        if layers and (layers[0] < 1 or layers[-1] >= self.n_layer):
            raise ValueError(f"model.attention_layers: {list(layers)} must lie in [1, "
                             f"{self.n_layer - 1}] (layer 0 is RWKV: it defines v_first; "
                             f"n_layer={self.n_layer})")
        kv = self.attn_kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 0 or (
                kv and self.n_head % kv):
            raise ValueError(f"model.attn_kv_heads: {kv!r} must be 0 or a divisor of the "
                             f"{self.n_head} query heads")
        if not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 1:
            raise ValueError(f"model.rope_theta: expected a number > 1, got {self.rope_theta!r}")
        if self.head_size % 2:
            raise ValueError(f"model.head_size: {self.head_size} must be even for RoPE")

    @property
    def kv_heads(self) -> int:
        return self.attn_kv_heads or self.n_head

    @property
    def rwkv_layers(self) -> tuple[int, ...]:
        return tuple(l for l in range(self.n_layer) if l not in self.attention_layers)

    @classmethod
    def from_dict(cls, d, where: str = "model") -> "HybridConfig":
        if isinstance(d, dict) and isinstance(d.get("attention_layers"), list):
            d = {**d, "attention_layers": tuple(d["attention_layers"])}
        return super().from_dict(d, where)

    def to_dict(self):
        out = dataclasses.asdict(self)
        out["attention_layers"] = list(self.attention_layers)
        return out

    def param_count(self) -> int:
        """RWKV-7's count for the RWKV layers, plus per attention layer: two LayerNorms (4C),
        q and o (2C²), k and v (2·C·K·N), ChannelMix (C + 2·C·F)."""
        c = self.resolved()
        C, A, N = c.n_embd, len(c.attention_layers), c.head_size
        rwkv = dataclasses.replace(ModelConfig(), **{
            f.name: getattr(c, f.name) for f in dataclasses.fields(ModelConfig)})
        rwkv_only = dataclasses.replace(rwkv, n_layer=c.n_layer - A).param_count()
        attn = 4 * C + 2 * C * C + 2 * C * c.kv_heads * N + C + 2 * C * c.ffn_dim
        return rwkv_only + A * attn
