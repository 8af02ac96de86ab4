"""Hugging Face `LlamaForCausalLM` directories (`config.json` with `model_type: "llama"` +
safetensors) -> `(LlamaConfig, params tree)` of `lwm_jax.models.llama.Llama`.

Names (torch `nn.Linear` weights are `[out, in]`; ours are `x @ W`, so every matrix is
transposed; layer i's slice of our stacked `[L, ...]` arrays):

    model.embed_tokens.weight                       -> embed            [V, C]
    model.layers.i.input_layernorm.weight           -> blocks.attn_norm.weight[i]
    model.layers.i.self_attn.{q,k,v,o}_proj.weight  -> blocks.attn.{q,k,v,o}[i] (transposed)
    model.layers.i.post_attention_layernorm.weight  -> blocks.mlp_norm.weight[i]
    model.layers.i.mlp.{gate,up,down}_proj.weight   -> blocks.mlp.{gate,up,down}[i] (transposed)
    model.norm.weight                               -> norm.weight
    lm_head.weight                                  -> head (transposed; absent when
                                                       tie_word_embeddings)

RoPE pairing: HF's rotary code rotates element j of each head with element j + D/2
("rotate_half"), and Meta's weights were permuted into that order when they were converted to
HF; our `apply_rope` uses the same pairing, so the projections are copied as they are.

Config: `hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
`head_dim`, `intermediate_size`, `rms_norm_eps`, `vocab_size`, `tie_word_embeddings`,
`max_position_embeddings`, and RoPE from `rope_parameters` (transformers >= 5) or
`rope_theta` + `rope_scaling` (earlier): rope types "default", "linear" and "llama3" are
supported; "dynamic", "yarn" and the others, biases (`attention_bias`, `mlp_bias`) and an
activation other than SiLU are one-line errors. Tensor shapes are the truth; `config.json` is
checked against them.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from lwm_jax.interop.hf import CONFIG, _read_tensors, read_hf_config, require_config, shape_of
from lwm_jax.interop.params import check_finite
from lwm_jax.models.llama.config import LlamaConfig, RopeScaling
from lwm_jax.user_input import quote_path, short

LAYER = "model.layers.{}."
MATRICES = {("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj",
            ("attn", "v"): "self_attn.v_proj", ("attn", "o"): "self_attn.o_proj",
            ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj",
            ("mlp", "down"): "mlp.down_proj"}
NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_ROPE_TYPES = {"linear": "linear", "llama3": "llama3"}
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def is_llama(root: str | os.PathLike) -> bool:
    """True when `<root>/config.json` says `model_type: "llama"` (nothing else is read)."""
    file = Path(root) / CONFIG
    if not file.is_file():
        return False
    try:
        doc = read_hf_config(file)
    except ValueError:
        return False
    return doc.get("model_type") == "llama"


def _field(doc: dict, key: str, where: str, kind: type, default=None):
    """`doc[key]` as an int or a finite float (`kind`), `default` when absent or null; a string,
    a boolean, a fraction where an integer belongs (`num_attention_heads: 4.5`) or a non-finite
    number is a one-line ValueError naming the field, never a silent truncation."""
    value = doc.get(key)
    if value is None:
        return default
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (kind is float or integral))
    if not ok:
        what = "an integer" if kind is int else "a finite number"
        raise ValueError(f"{where}: config.json {key}={short(value)} is not {what}; fix the "
                         "file (Hugging Face writes it as a JSON number)")
    return kind(value)


def _rope_from(hf: dict, where: str) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta, scaling = params.get("rope_theta", hf.get("rope_theta", 10000.0)), params
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ValueError(f"{where}: config.json rope_theta={short(theta)} is not a number")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: config.json rope_scaling={short(scaling)} is not an object")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in _ROPE_TYPES:
        raise ValueError(f"{where}: config.json rope type {short(kind)} is not supported; "
                         "supported: default, linear, llama3")
    fields = {"kind": _ROPE_TYPES[kind], "factor": _field(scaling, "factor", where, float, 1.0)}
    if kind == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if name not in scaling:
                raise ValueError(f"{where}: config.json llama3 rope scaling has no {name!r}")
            kind_of = int if name == "original_max_position_embeddings" else float
            fields[name] = _field(scaling, name, where, kind_of)
    return float(theta), RopeScaling(**fields)


def _hf_field(internal: str, hf: dict) -> str | None:
    """The config.json field behind `LlamaConfig`'s `model.<internal>` (None: from shapes)."""
    rope_key = "rope_parameters" if isinstance(hf.get("rope_parameters"), dict) else "rope_scaling"
    if internal == "model.rope_theta":
        return ("rope_parameters.rope_theta" if rope_key == "rope_parameters"
                and "rope_theta" in hf["rope_parameters"] else "rope_theta")
    if internal.startswith("model.rope_scaling"):
        sub = internal[len("model.rope_scaling"):].lstrip(".")
        return f"{rope_key}.{'rope_type' if sub == 'kind' else sub}" if sub else rope_key
    return {"model.rms_eps": "rms_norm_eps",
            "model.max_seq_len": "max_position_embeddings"}.get(internal)


def _config_error(err: ValueError, hf: dict, config_file: str) -> ValueError:
    """`err` from building `LlamaConfig` / `RopeScaling` (naming our `model.<key>`) restated with
    the config.json field it came from."""
    text = str(err)
    internal, sep, detail = text.partition(": ")
    field = _hf_field(internal, hf) if sep else None
    if field is None:
        return ValueError(f"{config_file}: {text} (sizes read from config.json and the tensor "
                          "shapes); fix the file or re-export the checkpoint")
    return ValueError(f"{config_file}: field {field!r} {detail}; fix the value in the file or "
                      "re-download the checkpoint")


def config_from_hf_llama(sd: dict[str, np.ndarray], hf: dict, where: str,
                         config_file: str | None = None) -> LlamaConfig:
    """`LlamaConfig` from tensor shapes, cross-checked with `config.json` (`hf`, read from
    `config_file`, which error messages name)."""
    config_file = config_file or f"{where}: config.json"
    if hf.get("model_type") != "llama":
        raise ValueError(f"{where}: config.json model_type is {short(hf.get('model_type'))}, "
                         "expected 'llama'")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{where}: config.json {flag}=true; biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: config.json hidden_act={short(hf.get('hidden_act'))}; only "
                         "silu (SwiGLU) is supported")

    def need(name, ndim=2):
        if name not in sd:
            raise ValueError(f"{where}: tensor {name!r} is missing")
        return shape_of(sd[name], name, ndim, where)
    V, C = need("model.embed_tokens.weight")
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    L = max(layers) + 1 if layers else 0
    if not layers or layers != set(range(L)):
        raise ValueError(f"{where}: layer indices {sorted(layers)} are not 0..{L - 1}")
    q_width = need(LAYER.format(0) + "self_attn.q_proj.weight")[0]
    kv_width = need(LAYER.format(0) + "self_attn.k_proj.weight")[0]
    H = _field(hf, "num_attention_heads", where, int, 0)
    if H < 1 or q_width % H:
        raise ValueError(f"{where}: config.json num_attention_heads={short(H)} does not divide "
                         f"the query width {q_width}")
    D = q_width // H
    if kv_width % D:
        raise ValueError(f"{where}: key width {kv_width} is not a multiple of head_dim {D}")
    tied = bool(hf.get("tie_word_embeddings", "lm_head.weight" not in sd))
    ffn = int(need(LAYER.format(0) + "mlp.gate_proj.weight")[0])
    rms_eps = _field(hf, "rms_norm_eps", where, float, 1e-6)
    max_len = _field(hf, "max_position_embeddings", where, int, 2048)
    try:
        theta, scaling = _rope_from(hf, where)
        cfg = LlamaConfig(
            vocab_size=int(V), n_layer=L, n_embd=int(C), n_head=H, n_kv_head=kv_width // D,
            head_dim=D, ffn_hidden=ffn, rms_eps=rms_eps, rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=tied, max_seq_len=max_len)
    except ValueError as err:
        if str(err).startswith(where):          # already names the checkpoint and field
            raise
        raise _config_error(err, hf, config_file) from None
    checks = {"hidden_size": C, "num_hidden_layers": L, "vocab_size": V, "head_dim": D,
              "num_key_value_heads": cfg.n_kv_head, "intermediate_size": cfg.ffn_hidden}
    for key, value in checks.items():
        if _field(hf, key, where, int) not in (None, int(value)):
            raise ValueError(f"{where}: config.json {key}={short(hf[key])} but the weights say "
                             f"{value}")
    return cfg


def gather_llama(sd: dict[str, np.ndarray], cfg: LlamaConfig, where: str) -> dict:
    """Our params tree (float32, stacked blocks) from HF tensors; a missing, misshapen or
    unexpected tensor is a one-line ValueError naming it."""
    used: set[str] = set()

    def take(name, shape):
        if name not in sd:
            raise ValueError(f"{where}: tensor {name!r} is missing")
        arr = sd[name]
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(arr.shape)}, expected "
                             f"{tuple(shape)}")
        used.add(name)
        return np.asarray(arr, np.float32)

    C, V, F, L = cfg.n_embd, cfg.vocab_size, cfg.ffn_hidden, cfg.n_layer
    QW, KW = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    out_in = {("attn", "q"): (QW, C), ("attn", "k"): (KW, C), ("attn", "v"): (KW, C),
              ("attn", "o"): (C, QW), ("mlp", "gate"): (F, C), ("mlp", "up"): (F, C),
              ("mlp", "down"): (C, F)}
    blocks: dict = {"attn": {}, "mlp": {}}
    for (group, ours), theirs in MATRICES.items():
        blocks[group][ours] = np.stack([take(LAYER.format(i) + theirs + ".weight",
                                             out_in[group, ours]).T for i in range(L)])
    for ours, theirs in NORMS.items():
        blocks[ours] = {"weight": np.stack([take(LAYER.format(i) + theirs + ".weight", (C,))
                                            for i in range(L)])}
    tree = {"embed": take("model.embed_tokens.weight", (V, C)), "blocks": blocks,
            "norm": {"weight": take("model.norm.weight", (C,))}}
    if cfg.tie_embeddings:
        used.add("lm_head.weight")                       # a tied copy, if saved, is unused
    else:
        tree["head"] = take("lm_head.weight", (V, C)).T
    extra = sorted(k for k in sd if k not in used and not _IGNORED.search(k))
    if extra:
        raise ValueError(f"{where}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected); "
                         "not a plain LlamaForCausalLM checkpoint")
    return tree


def read_hf_llama(root: str | os.PathLike) -> tuple[LlamaConfig, dict]:
    """Read a Hugging Face LLaMA directory -> `(cfg, params tree)` (float32 NumPy leaves).

    Raises ValueError (one line) for a missing/garbled `config.json` or weight file, an
    unsupported variant, a config that disagrees with the weights, and a missing, unexpected,
    misshapen, complex or non-finite tensor.
    """
    root = Path(root)
    where = f"checkpoint {str(root)!r}"
    require_config(root)
    hf = read_hf_config(root / CONFIG)
    sd = _read_tensors(root)
    cfg = config_from_hf_llama(sd, hf, where, quote_path(root / CONFIG))
    tree = gather_llama(sd, cfg, where)
    check_finite(tree, where)
    return cfg, tree
