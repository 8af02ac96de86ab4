"""Module attributes that import on first use (PEP 562), so that light entry points (the CLI's
argument parsing, a family's `config` module) never import jax or flax."""
from __future__ import annotations

import importlib
import sys


def lazy_getattr(package: str, sources: dict[str, str]):
    """A module-level `__getattr__` for `package`: attribute `name` is `getattr(import_module(
    sources[name]), name)`, cached in the module on first use; other names raise
    AttributeError (so `from package import submodule` still falls back to importing it)."""
    def __getattr__(name):
        if name in sources:
            value = getattr(importlib.import_module(sources[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
