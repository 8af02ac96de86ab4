"""Data: binidx token files, the deterministic window sampler, the built-in corpus, `prepare`."""
from lwm_jax.data.binidx import BinIdxDataset, BinIdxError, BinIdxWriter, write_binidx
from lwm_jax.data.corpus import build_stdlib_corpus, stdlib_corpus
from lwm_jax.data.prepare import prepare, run_prepare
from lwm_jax.data.sampler import WindowSampler, split_train_val

__all__ = ["BinIdxDataset", "BinIdxError", "BinIdxWriter", "write_binidx", "build_stdlib_corpus",
           "stdlib_corpus", "prepare", "run_prepare", "WindowSampler",
           "split_train_val"]
