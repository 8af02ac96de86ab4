"""Public entry points: `load_pretrained`, `read_params`, `convert`, `export`.

Formats (`format=` argument; detected from the path when None):
  "rwkv-pth"  official RWKV-LM `.pth` file (bf16 as released; read with safe unpickling)
  "hf"        FLA / Hugging Face directory: `config.json` + `*.safetensors` (RWKV-7 from FLA;
              `model_type: "llama"` is read as a LLaMA model, `lwm_jax.interop.hf_llama`)
  "lwm"       our directory: `config.yaml` + orbax `params/` (what `convert` writes)
  "run"       a training run directory (`lwm_jax.train.checkpoint`): latest step's params
A string that is no local path but a Hugging Face Hub name ("RWKV/<repo>", or
"<owner>/<repo>/<file>.pth") is downloaded into the Hugging Face cache first
(`lwm_jax.interop.hub`; needs `huggingface_hub`; `HF_HUB_OFFLINE=1` uses the cache only).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import hf, hf_llama, hub, native, params, rwkv_pth
from lwm_jax.models.registry import DEFAULT_ARCH, arch_of_config
from lwm_jax.precision import Policy
from lwm_jax.runtime import RUNTIME_FIELDS, Runtime
from lwm_jax.tokenizers import get_tokenizer
from lwm_jax.tokenizers.world import WORLD_VOCAB_SIZE
from lwm_jax.user_input import check_output_dir, check_output_file

FORMATS = ("rwkv-pth", "hf", "lwm", "run")
EXPORT_FORMATS = ("rwkv-pth", "hf")
# Config fields that describe how to run the model, not its weights: callers may override them.


def detect_format(path: str | os.PathLike) -> str:
    """Guess the checkpoint format of `path` (see module docstring); one-line error if unknown."""
    p = Path(path)
    if p.is_file():
        if p.suffix in (".pth", ".pt"):
            return "rwkv-pth"
        raise ValueError(f"checkpoint {str(p)!r}: unknown file type {p.suffix!r}; expected an "
                         "official .pth file or a directory (pass format= to force one)")
    if p.is_dir():
        for name in (native.CONFIG, hf.CONFIG):     # a FIFO there is no "missing file"
            if os.path.lexists(p / name) and not (p / name).is_file():
                hf.regular_file(p / name, f"{name} must be a regular file")
        if native.is_native(p):
            return "lwm"
        if (p / hf.CONFIG).is_file():
            return "hf"
        from lwm_jax.interop import run_ckpt
        if run_ckpt.is_run_dir(p):
            return "run"
        raise ValueError(f"checkpoint {str(p)!r}: directory has neither config.yaml + params/ "
                         "(lwm), config.json (hf) nor training-run steps")
    if os.path.lexists(p):
        raise ValueError(f"checkpoint {str(p)!r}: not a regular file or directory (a FIFO, "
                         "device or socket); give the checkpoint file or directory itself")
    raise ValueError(f"checkpoint {str(p)!r}: no such file or directory")


def read_params(path: str | os.PathLike, format: str | None = None) -> tuple[ModelConfig, dict]:
    """Read any supported checkpoint -> `(model config, params tree of float32 NumPy arrays)`;
    the config is a `ModelConfig` (RWKV-7) or a `LlamaConfig`, as the checkpoint says.

    Raises ValueError (one line naming the file, field or tensor) for an unknown format, a
    damaged file, a config that disagrees with the weights, and a tensor holding NaN/inf (a
    checkpoint is never loaded with non-finite weights); ImportError for a .pth without torch,
    and for a Hub name without `huggingface_hub`.
    """
    if hub.is_hub_name(path):
        path = hub.resolve(path)
    fmt = format or detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"format: {fmt!r} is not one of {FORMATS}")
    if fmt == "rwkv-pth":
        return rwkv_pth.load_pth(path)
    if fmt == "hf":
        return hf_llama.read_hf_llama(path) if hf_llama.is_llama(path) else hf.read_hf(path)
    if fmt == "lwm":
        return native.load_native(path)        # restore_params checks finiteness
    from lwm_jax.interop import run_ckpt
    return run_ckpt.read_run_params(path)


def load_pretrained(path: str | os.PathLike, format: str | None = None,
                    policy: Policy | str = "fp32", **runtime: Any):
    """Load a checkpoint into a model of its family (`RWKV7`, `Llama`) -> `(model, config)`.

    `runtime` may set `wkv_impl`, `chunk_size`, `remat`, `scan_layers` (a
    `lwm_jax.runtime.Runtime`; they do not change the weights; `model.runtime` holds them).
    The returned config is the architecture the model was built with. Raises what
    `read_params` raises, and TypeError for an unknown keyword.
    """
    bad = sorted(set(runtime) - set(RUNTIME_FIELDS))
    if bad:
        raise TypeError(f"load_pretrained: unknown keyword {bad[0]!r}; runtime overrides are "
                        f"{', '.join(RUNTIME_FIELDS)}")
    rt = Runtime(**runtime)
    cfg, tree = read_params(path, format)
    return params.model_from_params(cfg, tree, policy, rt), cfg


def convert(input: str | os.PathLike, output_dir: str | os.PathLike,
            format: str | None = None) -> Path:
    """Convert an official `.pth` / HF directory into our `config.yaml` + orbax directory.

    The output directory is checked first (`native.check_target`), then the input is read
    (`read_params`); both raise one-line ValueErrors.
    """
    native.check_target(output_dir)
    cfg, tree = read_params(input, format)
    return native.save_native(cfg, tree, output_dir, source=os.fspath(input))


def _params_of(model_or_path, format: str | None) -> tuple[ModelConfig, dict]:
    if isinstance(model_or_path, (str, os.PathLike)):
        return read_params(model_or_path, format)
    cfg = getattr(model_or_path, "cfg", None)
    try:
        arch_of_config(cfg)
    except TypeError:
        raise TypeError("export: model_or_dir must be a model (with .cfg) or a checkpoint "
                        f"path, got {type(model_or_path).__name__}") from None
    return cfg, params.params_from_model(model_or_path)


# The tokenizer a model of each vocabulary size is taken to use when none is named (the same
# rule as `lwm-jax generate`): byte-level for 256 ids (the quickstart `lwm-jax train`), World
# for 65536 (the released RWKV-7 models).
AUTO_TOKENIZER = {256: "byte", WORLD_VOCAB_SIZE: "world"}


def _export_tokenizer(tokenizer, cfg):
    """The tokenizer whose files an HF export gets: "auto" = `AUTO_TOKENIZER` by the model's
    vocabulary size (None for other sizes, and, with a warning, when no World vocabulary is
    installed), None = none, a spec string (`lwm_jax.tokenizers.get_tokenizer`) or a tokenizer
    object."""
    if tokenizer == "auto":
        spec = AUTO_TOKENIZER.get(cfg.vocab_size)
        if spec is None:
            return None
        try:
            return get_tokenizer(spec)
        except FileNotFoundError as err:
            warnings.warn(f"export: no tokenizer files written ({err})", stacklevel=3)
            return None
    return get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer


def export(model_or_dir, output: str | os.PathLike, format: str = "rwkv-pth",
           dtype: str | None = None, input_format: str | None = None,
           max_shard_bytes: int | None = None, tokenizer="auto") -> Path:
    """Write a model (or any readable checkpoint) in an external layout.

    format "rwkv-pth": `output` is the `.pth` file; dtype "bf16" (default, as released) or "f32".
    format "hf": `output` is a directory; dtype "f32" (default) or "bf16"; `max_shard_bytes`
    splits the weights into shards with a `model.safetensors.index.json`; `tokenizer` ("auto":
    the byte-level tokenizer for a 256-id model, World for a 65536-id one; None; a spec such as
    "byte", "world" or "hf:/path/tokenizer.json"; or a tokenizer) adds its files
    (`tokenizer.json`, ...), so that transformers' `AutoTokenizer` loads the directory.
    The output path and (for rwkv-pth) the torch install are checked before anything is read;
    every problem is a one-line ValueError (ImportError when torch is missing).
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"format: {format!r} is not one of {EXPORT_FORMATS}")
    if format != "hf" and tokenizer not in ("auto", None):
        raise ValueError(f"tokenizer: only the hf format stores tokenizer files, not {format!r}")
    out = Path(output)
    if format == "rwkv-pth":
        from lwm_jax.interop.torch_io import require_torch
        require_torch("export --format rwkv-pth")
        check_output_file(out, "output")
        check_output_dir(out.parent, "output")      # the directory the file goes into
        if out.suffix != ".pth":
            raise ValueError(f"output: {str(out)!r} must be a file name ending in .pth "
                             "(the rwkv package appends .pth to the name it is given)")
    else:
        check_output_dir(out, "output")
    cfg, tree = _params_of(model_or_dir, input_format)
    tok = _export_tokenizer(tokenizer, cfg) if format == "hf" else None
    arch = arch_of_config(cfg).name
    if arch != DEFAULT_ARCH:
        raise ValueError(f"format: {format!r} export is for RWKV-7 models; this is a {arch} "
                         "model (lwm-jax convert writes it in our own format)")
    if format == "rwkv-pth":
        out.parent.mkdir(parents=True, exist_ok=True)
        rwkv_pth.save_pth(cfg, tree, out, dtype=dtype or "bf16")
    else:
        hf.write_hf(cfg, tree, out, dtype=dtype or "f32", max_shard_bytes=max_shard_bytes,
                    tokenizer=tok)
    return out
