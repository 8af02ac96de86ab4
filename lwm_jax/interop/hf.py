"""FLA / Hugging Face RWKV-7 layout (`config.json` + safetensors) <-> our params tree.

Matches flash-linear-attention's `RWKV7ForCausalLM` (`model_type: "rwkv7"`): names in
`layout.HF_TOP` / `layout.HF_BLOCK`. Differences from the official layout worth knowing:
the LoRA pairs are `nn.Linear`s (weights transposed, `x0` is the second Linear's bias, the gate
LoRA has no bias), layer 0 has no `v_lora`, and `ffn.x_k`, `k_k`, `k_a` are flat `[C]`.

Reading takes the weights from `model.safetensors`, a sharded set listed in
`model.safetensors.index.json`, or any `*.safetensors` in the directory. Sizes come from tensor
shapes; `config.json` is checked against them (a mismatch is an error, not a guess).
Safetensors are read with NumPy (bf16 via ml_dtypes): no torch needed. A truncated or garbled
file, a `config.json` that is not a JSON object or has a field of the wrong type, and complex or
non-finite tensors are one-line `ValueError`s naming the file, field or tensor.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import layout
from lwm_jax.interop.rwkv_pth import gather_params, scatter_params
from lwm_jax.user_input import check_output_dir, one_line, quote_path, short

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HF_DTYPES = {"f32": (np.float32, "float32"), "bf16": (ml_dtypes.bfloat16, "bfloat16")}


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
               int: "a number", float: "a number", type(None): "null"}


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def regular_file(file: Path, fix: str) -> Path:
    """`file` when it is a regular file; else a one-line ValueError. Opening a FIFO, a socket or
    a device blocks or reads forever, so no checkpoint reader opens anything else."""
    if not Path(file).is_file():
        what = "missing" if not os.path.lexists(file) else "not a regular file (a FIFO, device, " \
            "socket or directory)"
        raise ValueError(f"{quote_path(file)}: {what}; {fix}")
    return Path(file)


def read_json(file: Path, fix: str):
    """Parse a JSON file; ValueError (one line naming `file`, ending in `fix`) when it is not a
    regular file, not UTF-8, not JSON or nested absurdly deep."""
    regular_file(file, fix)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{quote_path(file)}: not valid JSON ({err.msg} at line {err.lineno}, "
                         f"column {err.colno}); {fix}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{quote_path(file)}: not UTF-8 text (byte {err.start}); {fix}") from None
    except RecursionError:
        raise ValueError(f"{quote_path(file)}: JSON nested too deeply; {fix}") from None


def safetensors_arrays(file: Path, fix: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as NumPy; ValueError (one line naming the file,
    ending in `fix`) when it is truncated, garbled or unreadable."""
    from safetensors import safe_open
    regular_file(file, fix)
    try:
        with safe_open(str(file), framework="np") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:    # SafetensorError, OSError, ... for a damaged file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{quote_path(file)}: not a readable safetensors file "
                         f"({one_line(first, 160)}); {fix}") from None


def _read_tensors(root: Path) -> dict[str, np.ndarray]:
    fix = "re-download or re-export the checkpoint"
    index = root / INDEX
    if index.is_file():
        doc = read_json(index, fix)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()):
            raise ValueError(f"{quote_path(index)}: expected an object whose 'weight_map' maps "
                             f"tensor names to file names in the same directory; {fix}")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (root / name).is_file():
                raise ValueError(f"{quote_path(root / name)}: listed in {INDEX} but missing; {fix}")
    elif (root / SINGLE).is_file():
        files = [SINGLE]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {str(root)!r}: no *.safetensors weights next to config.json")
    out: dict[str, np.ndarray] = {}
    for name in files:
        for key, arr in safetensors_arrays(root / name, fix).items():
            if arr.dtype.kind == "c":
                raise ValueError(f"{quote_path(root / name)}: tensor {key!r} is complex "
                                 f"({arr.dtype}); RWKV weights are real and the imaginary part "
                                 "would be lost")
            if arr.dtype.kind in "iub":
                raise ValueError(f"{quote_path(root / name)}: tensor {key!r} has dtype "
                                 f"{arr.dtype}; weights must be floating point (re-export the "
                                 "checkpoint with float32/bfloat16/float16 weights)")
            out[key] = np.asarray(arr, dtype=np.float32)
    return out


def shape_of(arr: np.ndarray, name: str, ndim: int, where: str) -> tuple[int, ...]:
    """`arr.shape` when it has `ndim` dimensions; else a one-line ValueError naming `name`
    (sizes are read from shapes, so a wrong rank must not reach an unpacking or an index)."""
    shape = tuple(int(d) for d in np.shape(arr))
    if len(shape) != ndim:
        raise ValueError(f"{where}: tensor {name!r} has shape {shape}, expected {ndim} "
                         "dimensions; re-export the checkpoint")
    return shape


# config.json fields read here and the JSON types they must have
_INT_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "head_dim",
               "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "max_position_embeddings")
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "norm_eps")
_BOOL_FIELDS = ("tie_word_embeddings", "norm_bias")
_STR_FIELDS = ("model_type", "hidden_act")


def read_hf_config(file: Path) -> dict:
    """`config.json` as a dict whose fields read here have the right JSON types; ValueError
    (one line naming the file and field) otherwise."""
    fix = "fix config.json or re-download the checkpoint"
    doc = read_json(file, fix)
    if not isinstance(doc, dict):
        raise ValueError(f"{quote_path(file)}: expected a JSON object of model settings, got "
                         f"{_json_type(doc)}; is this a Hugging Face config.json?")

    def wrong(field, expected):
        value = doc[field]
        raise ValueError(f"{quote_path(file)}: field {field!r} is {_json_type(value)} "
                         f"({short(value)}), expected {expected}; {fix}")

    for field in _INT_FIELDS:
        value = doc.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            wrong(field, "an integer")
    for field in _NUMBER_FIELDS:
        value = doc.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            wrong(field, "a finite number")
    for field in _BOOL_FIELDS:
        if doc.get(field) is not None and not isinstance(doc[field], bool):
            wrong(field, "true or false")
    for field in _STR_FIELDS:
        if doc.get(field) is not None and not isinstance(doc[field], str):
            wrong(field, "a string")
    vd = doc.get("value_dim")
    if vd is not None:
        items = vd if isinstance(vd, list) else [vd]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            wrong("value_dim", "an integer or a list of integers")
    return doc


def _normalise(sd: dict[str, np.ndarray], hf_cfg: dict, where: str) -> dict[str, np.ndarray]:
    """Undo FLA variants: fused `x_x [6, C]`, tied head, bias-free norms."""
    fused, order = layout.HF_FUSED_MIX
    for key in [k for k in sd if k.endswith("." + fused)]:
        if sd[key].size % len(order) or sd[key].ndim == 0:
            raise ValueError(f"{where}: tensor {key!r} has shape {tuple(sd[key].shape)}, expected "
                             f"[{len(order)}, hidden_size]; re-export the checkpoint")
        stack = sd.pop(key).reshape(len(order), -1)
        for j, m in enumerate(order):
            sd[key[: -len(fused)] + f"attn.x_{m}"] = stack[j]
    if "lm_head.weight" not in sd and hf_cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = sd["model.embeddings.weight"]
    if hf_cfg.get("norm_bias", True) is False:
        for key in [k for k in sd if re.search(r"(norm|g_norm)\.weight$", k)]:
            sd.setdefault(key[: -len("weight")] + "bias", np.zeros_like(sd[key]))
    return sd


def config_from_hf(sd: dict[str, np.ndarray], hf_cfg: dict, where: str) -> ModelConfig:
    """`ModelConfig` from tensor shapes, cross-checked with `config.json`."""
    if hf_cfg.get("model_type") != "rwkv7":
        raise ValueError(f"{where}: config.json model_type is {short(hf_cfg.get('model_type'))}, "
                         "expected 'rwkv7'")
    def need(name, ndim=2):
        if name not in sd:
            raise ValueError(f"{where}: tensor {name!r} is missing")
        return shape_of(sd[name], name, ndim, where)
    V, C = need("model.embeddings.weight")
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    L = max(layers) + 1 if layers else 0
    if not layers or layers != set(range(L)):
        raise ValueError(f"{where}: layer indices {sorted(layers)} are not 0..{L - 1}")
    H, N = need("model.layers.0.attn.r_k")
    lay = "model.layers.{}.attn.{}_lora.lora.0.weight"
    v_name = next((lay.format(i, "v") for i in (1, 0) if lay.format(i, "v") in sd), None)
    F = need("model.layers.0.ffn.key.weight")[0]
    if F % C or H * N != C:
        raise ValueError(f"{where}: ffn width {F} or heads {H}x{N} do not fit hidden size {C}")
    cfg = ModelConfig(
        vocab_size=int(V), n_layer=L, n_embd=int(C), head_size=int(N),
        decay_lora=int(need(lay.format(0, "w"))[0]),
        a_lora=int(need(lay.format(0, "a"))[0]),
        v_lora=int(need(v_name)[0]) if v_name else None,   # one layer: the rule
        gate_lora=int(need(lay.format(0, "g"))[0]), ffn_mult=int(F // C)).resolved()
    checks = {"hidden_size": C, "num_hidden_layers": L, "vocab_size": V, "head_dim": N}
    for key, value in checks.items():
        if hf_cfg.get(key) is not None and int(hf_cfg[key]) != int(value):
            raise ValueError(f"{where}: config.json {key}={short(hf_cfg[key])} but the weights "
                             f"say {value}")
    vd = hf_cfg.get("value_dim")
    if vd is not None and any(int(x) != C for x in (vd if isinstance(vd, list) else [vd])):
        raise ValueError(f"{where}: config.json value_dim={short(vd)}; only value_dim == "
                         "hidden_size is supported")
    if hf_cfg.get("hidden_act", "sqrelu") != "sqrelu" or hf_cfg.get("attn"):
        raise ValueError(f"{where}: config.json hidden_act/attn describe a variant "
                         "(non-sqrelu or hybrid attention) that is not supported")
    return cfg


def require_config(root: Path) -> None:
    """ValueError (one line) when `<root>/config.json` is missing or not a regular file."""
    file = root / CONFIG
    if file.is_file():
        return
    if os.path.lexists(file):
        regular_file(file, "give a Hugging Face model directory whose config.json is a file")
    raise ValueError(f"checkpoint {str(root)!r}: no config.json; expected a Hugging Face model "
                     "directory")


def read_hf(root: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Read an FLA/HF RWKV-7 directory -> `(cfg, params tree)` (float32 leaves).

    Raises ValueError (one line) for a missing/garbled `config.json` or weight file, a config
    field of the wrong type or disagreeing with the weights, and a missing, unexpected,
    misshapen, complex or non-finite tensor.
    """
    root = Path(root)
    where = f"checkpoint {str(root)!r}"
    require_config(root)
    hf_cfg = read_hf_config(root / CONFIG)
    sd = _normalise(_read_tensors(root), hf_cfg, where)
    cfg = config_from_hf(sd, hf_cfg, where)
    return cfg, gather_params(sd, cfg, layout.HF_TOP, layout.HF_BLOCK, "model.layers.{i}.",
                              layout.HF_LAYER0_ABSENT, where)


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    """FLA `RWKV7Config` fields describing `cfg` (token 0 is RWKV's end-of-document id)."""
    C, L = cfg.n_embd, cfg.n_layer
    return {
        "architectures": ["RWKV7ForCausalLM"], "model_type": "rwkv7", "attn_mode": "chunk",
        "hidden_size": C, "hidden_ratio": cfg.ffn_mult, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": L, "head_dim": cfg.head_size, "num_heads": cfg.n_head,
        "decay_low_rank_dim": cfg.decay_lora, "a_low_rank_dim": cfg.a_lora,
        "v_low_rank_dim": cfg.v_lora, "gate_low_rank_dim": cfg.gate_lora,
        "hidden_act": "sqrelu", "norm_first": True, "norm_bias": True, "norm_eps": 1e-5,
        "vocab_size": cfg.vocab_size, "value_dim": [C] * L, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 0, "use_cache": True, "fuse_norm": True,
        "fuse_cross_entropy": True, "use_l2warp": True, "max_position_embeddings": 2048,
        "initializer_range": 0.02, "torch_dtype": HF_DTYPES[dtype][1],
    }


def write_hf(cfg: ModelConfig, tree: dict, out_dir: str | os.PathLike, dtype: str = "f32",
             max_shard_bytes: int | None = None, tokenizer=None) -> None:
    """Write `config.json` + `model.safetensors` (or shards + index when `max_shard_bytes`),
    and `tokenizer`'s Hugging Face files when one is given (`lwm_jax.tokenizers.hf_files`:
    `tokenizer.json` + `tokenizer_config.json`, so `AutoTokenizer` loads the directory).

    Raises ValueError (one line) for a bad dtype, an `out_dir` that is a file or cannot be
    written, and a tokenizer with more ids than the model or without such files.
    """
    from safetensors.numpy import save_file
    if dtype not in HF_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {tuple(HF_DTYPES)}")
    check_output_dir(out_dir, "output")
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer: {tokenizer.name!r} has {tokenizer.vocab_size} ids but the "
                         f"model only {cfg.vocab_size}")
    np_dtype = HF_DTYPES[dtype][0]
    tensors = scatter_params(cfg, tree, layout.HF_TOP, layout.HF_BLOCK, "model.layers.{i}.",
                             layout.HF_LAYER0_ABSENT)
    tensors = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()}
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG).write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    if tokenizer is not None:
        from lwm_jax.tokenizers.hf_files import write_tokenizer_files
        write_tokenizer_files(tokenizer, root)
    meta = {"format": "pt"}
    if not max_shard_bytes:
        save_file(tensors, str(root / SINGLE), metadata=meta)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    weight_map = {}
    for j, shard in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": weight_map}
    (root / INDEX).write_text(json.dumps(index, indent=2) + "\n")
