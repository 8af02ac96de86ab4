"""Reading and writing PyTorch `.pth` state dicts without ever running pickled code.

PyTorch is optional: it is imported only here, only when a `.pth` file is read or written.
Loading always uses `torch.load(..., weights_only=True)`, whose restricted unpickler accepts only
tensors and plain containers; anything else (a `__reduce__` that would call `os.system`, a custom
class) is refused before it can run, and reported as a one-line `ValueError`. Tensors that
cannot stand for dense real weights (meta, sparse, nested, quantized or complex tensors) are
refused by name instead of being converted lossily.

Torch hands a path to C++ as UTF-8, which a name that is not valid UTF-8 (bytes of another
encoding, carried in a Python str as surrogates) cannot be, so such a file is opened by Python
and torch gets the open file; reading it that way is not memory-mapped (the whole file is read).
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
from typing import Mapping

import numpy as np

from lwm_jax.interop.orbax_files import is_utf8
from lwm_jax.user_input import one_line

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
    """Read a `.pth` state dict as `{name: float32 NumPy array}`.

    bf16 / fp16 tensors are widened to float32 exactly; views, transposed or expanded tensors
    are copied out densely. Raises ValueError (one line) for a malicious or non-tensor pickle, a
    missing or unreadable file, a file that is not a mapping of tensors, and a tensor that is
    meta, sparse, nested, quantized, complex or not floating point (named). ImportError when torch is missing.
    """
    torch = require_torch(f"reading {os.fspath(path)!r}")
    if not os.path.isfile(path):
        what = ("not a regular file (a FIFO, device, socket or directory)"
                if os.path.lexists(path) else "no such file")
        raise ValueError(f"checkpoint {os.fspath(path)!r}: {what}")
    with warnings.catch_warnings():      # torch's own deprecation notes are no use to the user
        warnings.simplefilter("ignore")
        return _load(torch, path)


def _torch_load(torch, path):
    if not is_utf8(path):             # see the module docstring
        with open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:  # legacy (non-zip) files cannot be memory-mapped
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _load(torch, path) -> dict[str, np.ndarray]:
    try:
        obj = _torch_load(torch, path)
    except pickle.UnpicklingError as err:
        raise ValueError(_refusal(path, err)) from None
    except Exception as err:    # truncated / garbled: zip, pickle or storage errors of any type
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint {os.fspath(path)!r}: not a readable PyTorch file "
                         f"({one_line(first, 200)}); re-download or re-save it") from None
    if not isinstance(obj, Mapping):
        raise ValueError(f"checkpoint {os.fspath(path)!r}: expected a state dict (name -> tensor), "
                         f"got {type(obj).__name__}")
    out: dict[str, np.ndarray] = {}
    where = f"checkpoint {os.fspath(path)!r}"
    for name, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: entry {name!r} is a {type(value).__name__}, not a "
                             "tensor; give a plain state dict (name -> tensor)")
        out[str(name)] = _to_numpy(torch, value, str(name), where)
    return out


def _to_numpy(torch, value, name: str, where: str) -> np.ndarray:
    """One tensor -> a dense NumPy array (floats as float32), or a one-line ValueError."""
    t = value.detach()
    problem = None
    if getattr(t, "is_nested", False):
        problem = "is a nested tensor; save dense tensors"
    elif t.is_meta:
        problem = "is a meta tensor (a shape without data); save the real weights"
    elif t.layout != torch.strided:
        problem = (f"has {str(t.layout).replace('torch.', '')} layout, not dense; save "
                   "tensor.to_dense()")
    elif t.is_quantized:
        problem = f"is quantized ({t.dtype}); dequantize it before saving"
    elif t.is_complex():
        problem = (f"is complex ({t.dtype}); RWKV weights are real and the imaginary part "
                   "would be lost")
    elif not t.is_floating_point():
        problem = (f"has dtype {str(t.dtype).replace('torch.', '')}; weights must be floating "
                   "point (re-save it as float32/bfloat16/float16)")
    if problem:
        raise ValueError(f"{where}: tensor {name!r} {problem}")
    try:
        t = t.cpu().resolve_conj().resolve_neg()
        if t.is_floating_point():
            t = t.to(torch.float32)
        return t.contiguous().numpy().copy()
    except Exception as err:     # an odd layout or dtype NumPy cannot hold
        raise ValueError(f"{where}: tensor {name!r} ({t.dtype}, shape {tuple(t.shape)}) cannot "
                         f"be read as an array ({one_line(err, 150)}); re-save it as a plain "
                         "dense tensor") from None


def save_state_dict(arrays: Mapping[str, np.ndarray], path: str | os.PathLike,
                    dtype: str = "bf16") -> None:
    """Write `{name: array}` with `torch.save` as a plain dict of tensors (`dtype`: bf16 | f32).

    Raises ValueError for a bad dtype or an unwritable path, OSError (ENOSPC) for a full disk.
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {TORCH_DTYPES}")
    torch = require_torch(f"writing {os.fspath(path)!r}")
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    tensors = {name: torch.from_numpy(np.array(a, dtype=np.float32, order="C")).to(tdtype)
               for name, a in arrays.items()}
    try:
        if is_utf8(path):
            torch.save(tensors, path)
        else:                        # see the module docstring
            with open(path, "wb") as f:
                torch.save(tensors, f)
    except OSError:
        raise
    except Exception as err:      # torch reports I/O failures as RuntimeError
        text = one_line(err, 200)
        if "No space left" in text:
            import errno
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path)) from None
        raise ValueError(f"output {os.fspath(path)!r}: cannot be written ({text}); choose a "
                         "writable location") from None
