"""Reading and writing PyTorch `.pth` state dicts without ever running pickled code.

PyTorch is optional: it is imported only here, only when a `.pth` file is read or written.
Loading always uses `torch.load(..., weights_only=True)`, whose restricted unpickler accepts only
tensors and plain containers; anything else (a `__reduce__` that would call `os.system`, a custom
class) is refused before it can run, and reported as a one-line `ValueError`.
"""
from __future__ import annotations

import os
import pickle
import re
from typing import Mapping

import numpy as np

TORCH_DTYPES = ("bf16", "f32")


def require_torch(what: str):
    """Import torch or raise a one-line ImportError saying what needed it and how to install it."""
    try:
        import torch
    except ImportError:
        raise ImportError(f"{what} needs PyTorch, which is not installed; install the CPU build "
                          "with `pip install torch --index-url https://download.pytorch.org/whl/cpu` "
                          "(or `pip install lwm_jax[torch]`)") from None
    return torch


def _refusal(path, err: Exception) -> str:
    text = str(err)
    found = re.search(r"unsupported GLOBAL ([\w.]+)", text, re.IGNORECASE)
    other = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    detail = (f"it references {found.group(1)}" if found
              else other.group(1).strip() if other else text.strip().splitlines()[0][:120])
    return (f"checkpoint {os.fspath(path)!r}: refused to unpickle: not a plain state dict of "
            f"tensors ({detail}); pickled code is never run")


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a `.pth` state dict as `{name: float32 (or integer) NumPy array}`.

    bf16 / fp16 tensors are widened to float32 exactly. Raises ValueError (one line) for a
    malicious or non-tensor pickle, a missing file, or a file that is not a mapping of tensors.
    """
    torch = require_torch(f"reading {os.fspath(path)!r}")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {os.fspath(path)!r}: no such file")
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(err):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(_refusal(path, err)) from None
    except (RuntimeError, EOFError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint {os.fspath(path)!r}: not a readable PyTorch file ({first})") from None
    if not isinstance(obj, Mapping):
        raise ValueError(f"checkpoint {os.fspath(path)!r}: expected a state dict (name -> tensor), "
                         f"got {type(obj).__name__}")
    out: dict[str, np.ndarray] = {}
    for name, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint {os.fspath(path)!r}: entry {name!r} is a "
                             f"{type(value).__name__}, not a tensor")
        t = value.detach().cpu()
        if t.is_floating_point():
            t = t.to(torch.float32)
        out[str(name)] = t.contiguous().numpy().copy()
    return out


def save_state_dict(arrays: Mapping[str, np.ndarray], path: str | os.PathLike,
                    dtype: str = "bf16") -> None:
    """Write `{name: array}` with `torch.save` as a plain dict of tensors (`dtype`: bf16 | f32)."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {TORCH_DTYPES}")
    torch = require_torch(f"writing {os.fspath(path)!r}")
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(tdtype)
               for name, a in arrays.items()}
    torch.save(tensors, path)
