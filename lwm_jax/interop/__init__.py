"""Checkpoint interop: official RWKV-LM `.pth`, FLA / Hugging Face, and our orbax directories.

    model, cfg = load_pretrained("RWKV-x070-World-0.1B.pth")      # format detected
    model, cfg = load_pretrained("Llama-3.2-1B/")                 # HF LlamaForCausalLM -> Llama
    convert("RWKV-x070-World-0.1B.pth", "ckpt/0.1b")              # -> config.yaml + params/
    export(model, "out.pth", format="rwkv-pth")                   # or format="hf", a directory
"""
from lwm_jax.interop.api import (EXPORT_FORMATS, FORMATS, convert, detect_format, export,
                                 load_pretrained, read_params)
from lwm_jax.interop.cli import convert_main, export_main
from lwm_jax.interop.params import model_from_params, params_from_model

__all__ = ["load_pretrained", "read_params", "convert", "export", "detect_format",
           "model_from_params", "params_from_model", "FORMATS", "EXPORT_FORMATS",
           "convert_main", "export_main"]
