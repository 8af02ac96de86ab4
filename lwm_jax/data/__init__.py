"""Data: token files, text sources and the samplers that turn them into training windows.

Modules:
  * `binidx`: Megatron / GPT-NeoX binidx token files (memory-mapped reader, streaming writer);
  * `sampler`: the deterministic, checkpointable window sampler over a token array;
  * `permutation`: stateless seeded permutations of `range(n)`, the samplers' order;
  * `corpus`: the built-in corpus (this Python's standard library) and the validation split rule;
  * `prepare`: tokenise text files into a binidx dataset (`lwm-jax prepare`);
  * `text_sources`: text documents (files, `hf:` datasets) read in order from a resumable position;
  * `stream`: windows from text tokenised on the fly, or from binidx tokens, behind one interface;
  * `mixture`: global batches drawn from weighted window sources (`data.sources`).
"""
from lwm_jax.data.binidx import BinIdxDataset, BinIdxError, BinIdxWriter, write_binidx
from lwm_jax.data.corpus import build_stdlib_corpus, stdlib_corpus
from lwm_jax.data.prepare import prepare, run_prepare
from lwm_jax.data.sampler import WindowSampler, split_train_val

__all__ = ["BinIdxDataset", "BinIdxError", "BinIdxWriter", "write_binidx", "build_stdlib_corpus",
           "stdlib_corpus", "prepare", "run_prepare", "WindowSampler",
           "split_train_val"]
