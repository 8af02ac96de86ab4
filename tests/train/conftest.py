"""Fixtures the training tests share: JAX's persistent compilation cache, and a binidx data set
written once per test module from the documents that module asks for."""
from __future__ import annotations

import numpy as np
import pytest

from lwm_jax.data import write_binidx
from lwm_jax.train.compile_cache import enable_compilation_cache


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Turn on JAX's persistent compilation cache in the session's temporary directory and return
    that directory: runs of one config compile the same programs, so they share them through
    JAX's disk cache (a subprocess, through `JAX_COMPILATION_CACHE_DIR`). A module whose every
    test should use it says `pytestmark = pytest.mark.usefixtures("compile_cache")`."""
    return enable_compilation_cache(str(tmp_path_factory.getbasetemp() / "jax-compile"))


@pytest.fixture(scope="module")
def data_prefix(request, tmp_path_factory):
    """The prefix of a binidx pair (uint16 ids, every document ended by the EOD token) holding
    the requesting module's `DATA_DOCS`: `(count, length)` for `count` documents of `length`
    random byte ids 1..255, or a function that makes the documents from the random generator.
    The generator is seeded with 0, so every run of the module trains on the same data."""
    docs = request.module.DATA_DOCS
    rng = np.random.default_rng(0)
    if callable(docs):
        docs = docs(rng)
    else:
        count, length = docs
        docs = [rng.integers(1, 256, length) for _ in range(count)]
    prefix = str(tmp_path_factory.mktemp("data") / "docs")
    write_binidx(prefix, docs, np.uint16, append_eod=True)
    return prefix
