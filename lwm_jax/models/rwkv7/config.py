"""RWKV-7 model configuration (typed, validated).

The training/run configuration (data, optimizer, checkpoints) lives in `lwm_jax.train.config` and
embeds a `ModelConfig` under its `model:` key.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from lwm_jax.runtime import RUNTIME_FIELDS


LORA_FIELDS = ("decay_lora", "a_lora", "v_lora", "gate_lora")


def default_lora_rank(factor: float) -> int:
    """RWKV-LM's rule for a low-rank size: `max(32, round(factor / 32) * 32)`."""
    return max(32, int(round(factor / 32)) * 32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of an RWKV-7 model.

    Attributes:
      vocab_size: V (65536 for the RWKV World vocabulary, 256 for byte-level).
      n_layer: L.
      n_embd: C (must be a multiple of `head_size`).
      head_size: N (64 in every released model).
      decay_lora / a_lora / v_lora / gate_lora: low-rank sizes (positive); None (`null` or the
        key left out) = RWKV-LM's default rule (see `resolved()`); read from tensor shapes when
        importing a checkpoint. 0 is refused: it reads as "no LoRA", which RWKV-7 has no form of.
      ffn_mult: ChannelMix hidden size = ffn_mult * C (4 in RWKV-7).

    Architecture only: how the model runs (WKV implementation, chunk, remat, layer scan) is a
    `lwm_jax.runtime.Runtime`, passed to the model beside this config.
    """

    vocab_size: int = 65536
    n_layer: int = 12
    n_embd: int = 768
    head_size: int = 64
    decay_lora: int | None = None
    a_lora: int | None = None
    v_lora: int | None = None
    gate_lora: int | None = None
    ffn_mult: int = 4

    def __post_init__(self):
        def bad(field, msg):
            raise ValueError(f"model.{field}: {msg}")
        for f in ("vocab_size", "n_layer", "n_embd", "head_size", "ffn_mult"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, f"must be a positive integer, got {v!r}")
        if self.n_embd % self.head_size:
            bad("n_embd", f"{self.n_embd} is not a multiple of model.head_size={self.head_size}")
        rule = self.default_lora_ranks()
        for f in LORA_FIELDS:
            v = getattr(self, f)
            if v is None:
                continue
            fix = f"write null (or leave the key out) for RWKV-LM's rule ({rule[f]} here) or a " \
                  "positive size"
            if isinstance(v, int) and not isinstance(v, bool) and v == 0:
                bad(f, f"0 is not a low-rank size (RWKV-7 has no form without this LoRA); {fix}")
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, f"must be a positive integer, got {v!r}; {fix}")

    @property
    def n_head(self) -> int:
        return self.n_embd // self.head_size

    @property
    def ffn_dim(self) -> int:
        return self.ffn_mult * self.n_embd

    def default_lora_ranks(self) -> dict[str, int]:
        """RWKV-LM's low-rank sizes for this width: `default_lora_rank(f)` with
        decay, a: f = 2.5·√C·(N/64); v: f = 1.7·√C·(N/64); gate: f = 5·√C."""
        root, hs = math.sqrt(self.n_embd), self.head_size / 64
        return {"decay_lora": default_lora_rank(2.5 * root * hs),
                "a_lora": default_lora_rank(2.5 * root * hs),
                "v_lora": default_lora_rank(1.7 * root * hs),
                "gate_lora": default_lora_rank(5 * root)}

    def resolved(self) -> "ModelConfig":
        """Copy with every low-rank size left as None set by RWKV-LM's rule."""
        rule = self.default_lora_ranks()
        return dataclasses.replace(self, **{f: rule[f] if getattr(self, f) is None
                                            else getattr(self, f) for f in LORA_FIELDS})

    def param_count(self) -> int:
        """`2VC + 4C + L(19C + 12C² + 2C(dw+da+dv+dg))` (ffn_mult=4), computed from the shapes."""
        c = self.resolved()
        C, L = c.n_embd, c.n_layer
        lora = c.decay_lora + c.a_lora + c.v_lora + c.gate_lora
        per_layer = 19 * C + 4 * C * C + 2 * C * c.ffn_dim + 2 * C * lora
        return 2 * c.vocab_size * C + 4 * C + L * per_layer

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "model") -> "ModelConfig":
        """Build from a plain dict (YAML `model:` section, a checkpoint's saved config); unknown
        keys are a one-line error. The runtime keys older files kept here (`wkv_impl`,
        `chunk_size`, `remat`, `scan_layers`) are not architecture and are left out (a run
        config moves them to its `runtime:` section first: `split_legacy_runtime`).
        A config a run or checkpoint wrote goes through `upgrade_saved_model` first."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if k not in RUNTIME_FIELDS}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key; valid keys: {', '.join(sorted(names))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def upgrade_saved_model(d: dict[str, Any]) -> dict[str, Any]:
    """A saved `model:` mapping (a run dir's or checkpoint's config.yaml) in today's terms: files
    written before low-rank sizes took `null` for RWKV-LM's rule wrote 0 for it, which a config
    now refuses; read there, 0 still means the rule."""
    return {k: None if k in LORA_FIELDS and v == 0 and not isinstance(v, bool) else v
            for k, v in d.items()}
