"""JAX's persistent compilation cache for `lwm-jax train`.

A second run of the same config (a resume, a rerun) then loads the compiled train and eval steps
from disk instead of recompiling them (seconds on CPU, minutes for big models on GPU/TPU).
The entry point turns it on before the first computation; library users call it themselves.
"""
from __future__ import annotations

import os

import jax

from lwm_jax.data.corpus import cache_root


def enable_compilation_cache(directory: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache; returns the directory used.

    Default directory: $JAX_COMPILATION_CACHE_DIR if set, else `<lwm_jax cache>/jax-compile`
    (the data cache root: $LWM_JAX_CACHE, $XDG_CACHE_HOME/lwm_jax or ~/.cache/lwm_jax).
    Every compiled program is cached (no minimum compile time).
    """
    directory = (directory or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or str(cache_root() / "jax-compile"))
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory
