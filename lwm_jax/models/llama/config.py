"""LLaMA-style decoder configuration (typed, validated; imports no jax).

A run config selects this with `arch: llama`; its `model:` section then holds `LlamaConfig`
fields (`lwm_jax.train.config`). Sizes left at 0 take the default rule (`resolved()`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

ROPE_KINDS = ("linear", "ntk", "llama3")


def _bad(where: str, msg: str):
    raise ValueError(f"{where}: {msg}")


def _check_positive_int(where: str, value, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "an integer >= 0 (0 = the default rule)" if allow_zero else "a positive integer"
        _bad(where, f"must be {what}, got {value!r}")


def _check_number(where: str, value, low: float, inclusive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (value == low and not inclusive):
        _bad(where, f"must be a number {'>=' if inclusive else '>'} {low}, got {value!r}")


def _from_dict(cls, d: Any, where: str) -> dict:
    if not isinstance(d, dict):
        _bad(where, f"expected a mapping, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, d)) - names)
    if unknown:
        _bad(f"{where}.{unknown[0]}", f"unknown key; valid keys: {', '.join(sorted(names))}")
    return dict(d)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for contexts longer than the training one.

    kind: "linear" (all frequencies / factor), "ntk" (base theta * factor^(D/(D-2))) or
      "llama3" (LLaMA-3.1's band rule); `lwm_jax.layers.rope` has the formulas.
    factor: stretch factor (> 1 stretches).
    low_freq_factor, high_freq_factor, original_max_position_embeddings: the llama3 bands
      (wavelengths above original / low_freq_factor are slowed by `factor`, below original /
      high_freq_factor kept, blended between); read only for kind "llama3".
    """

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        where = "model.rope_scaling"
        if self.kind not in ROPE_KINDS:
            _bad(f"{where}.kind", f"{self.kind!r} is not one of {ROPE_KINDS} (use "
                                  "rope_scaling: null for no scaling)")
        _check_number(f"{where}.factor", self.factor, 0.0)
        _check_number(f"{where}.low_freq_factor", self.low_freq_factor, 0.0)
        _check_number(f"{where}.high_freq_factor", self.high_freq_factor, 0.0)
        _check_positive_int(f"{where}.original_max_position_embeddings",
                            self.original_max_position_embeddings)
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            _bad(f"{where}.high_freq_factor", f"{self.high_freq_factor} must be larger than "
                                              f"low_freq_factor={self.low_freq_factor}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "model.rope_scaling") -> "RopeScaling":
        return cls(**_from_dict(cls, d, where))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-style decoder (pre-norm RMSNorm blocks, grouped-query attention with
    RoPE, SwiGLU MLP).

    Attributes:
      vocab_size: V. n_layer: L. n_embd: C, the residual width (HF `hidden_size`).
      n_head: H query heads. n_kv_head: K key/value heads (H % K == 0; K = H is multi-head).
      head_dim: D per head; 0 = n_embd // n_head.
      ffn_hidden: F, the SwiGLU width (HF `intermediate_size`); 0 = 8C/3 rounded up to a
        multiple of 64.
      rms_eps: RMSNorm epsilon. rope_theta: RoPE base. rope_scaling: `RopeScaling` or None.
      tie_embeddings: the head reuses the embedding matrix (no separate `head` parameter).
      max_seq_len: longest sequence the model is meant for (KV caches are sized by it when no
        other length is given; generation refuses to go past it).
    How the model runs (remat, layer scan) is a `lwm_jax.runtime.Runtime`, as for RWKV-7.
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 0
    ffn_hidden: int = 0
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    max_seq_len: int = 2048

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (one line naming `model.<field>` and the fix) for a bad value."""
        for f in ("vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "max_seq_len"):
            _check_positive_int(f"model.{f}", getattr(self, f))
        for f in ("head_dim", "ffn_hidden"):
            _check_positive_int(f"model.{f}", getattr(self, f), allow_zero=True)
        _check_number("model.rms_eps", self.rms_eps, 0.0)
        _check_number("model.rope_theta", self.rope_theta, 1.0)
        if not isinstance(self.tie_embeddings, bool):
            _bad("model.tie_embeddings", f"must be true or false, got {self.tie_embeddings!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            _bad("model.rope_scaling", "must be a RopeScaling (a mapping in YAML) or null, got "
                                       f"{type(self.rope_scaling).__name__}")
        if self.n_head % self.n_kv_head:
            _bad("model.n_kv_head", f"{self.n_kv_head} does not divide model.n_head="
                                    f"{self.n_head}; choose a divisor of it")
        if self.head_dim == 0 and self.n_embd % self.n_head:
            _bad("model.n_embd", f"{self.n_embd} is not a multiple of model.n_head="
                                 f"{self.n_head}; set model.head_dim explicitly")
        if self.resolved_head_dim % 2:
            _bad("model.head_dim", f"{self.resolved_head_dim} must be even (RoPE rotates pairs)")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def resolved_ffn_hidden(self) -> int:
        return self.ffn_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def resolved(self) -> "LlamaConfig":
        """Copy with `head_dim` and `ffn_hidden` filled in by their default rules."""
        return dataclasses.replace(self, head_dim=self.resolved_head_dim,
                                   ffn_hidden=self.resolved_ffn_hidden)

    def param_count(self) -> int:
        """`VC (+ CV untied) + C + L(2C + C·HD + 2·C·KD + HD·C + 3·C·F)`."""
        c = self.resolved()
        C, V, L, F = c.n_embd, c.vocab_size, c.n_layer, c.ffn_hidden
        q_width, kv_width = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        per_layer = 2 * C + 2 * C * q_width + 2 * C * kv_width + 3 * C * F
        return V * C * (1 if c.tie_embeddings else 2) + C + L * per_layer

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "model") -> "LlamaConfig":
        """Build from a plain dict (YAML `model:` section, a saved config); unknown keys and
        bad values are one-line errors. `rope_scaling` is a mapping of `RopeScaling` fields
        or null."""
        d = _from_dict(cls, d, where)
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = RopeScaling.from_dict(d["rope_scaling"], f"{where}.rope_scaling")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
