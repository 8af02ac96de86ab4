"""Per-layer views of `[L, ...]` stacked parameters for a Python loop over layers, whose
gradient is one stack of the layers' gradients.

Indexing `a[l]` once per layer gives the same views, but the transpose of each index is a
zero-padded `[L, ...]` array, and the L of them are summed: in the 1.5B train step without the
layer scan that sum (`transpose(jvp())/add_any` in a profile's op paths) took a visible share of
the step on an H100 (`benchmarks/profile_summary.py` on a `benchmarks/train_step.py` profile;
figures in benchmarks/RESULTS-log.md). `unstack` returns all L views under one custom VJP whose
backward stacks the L cotangents: the same numbers (adding zeros is exact), one concatenation,
which XLA may also fuse into the optimizer's reads of the gradient.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def unstack(tree: Any, n: int) -> list[Any]:
    """`[tree with every leaf a[l]] for l in range(n)`; every leaf must have leading dim `n`.
    Differentiable: the cotangents of the n views come back stacked (unused views: zeros)."""
    for leaf in jax.tree.leaves(tree):
        if leaf.ndim == 0 or leaf.shape[0] != n:
            raise ValueError(f"unstack: a leaf of shape {tuple(leaf.shape)} has no leading "
                             f"layer axis of {n}")
    return _unstack(tree, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unstack(tree, n):
    return [jax.tree.map(lambda a: a[l], tree) for l in range(n)]


def _unstack_fwd(tree, n):
    return _unstack(tree, n), None


def _unstack_bwd(n, _, cotangents):
    return (jax.tree.map(lambda *c: jnp.stack(c), *cotangents),)


_unstack.defvjp(_unstack_fwd, _unstack_bwd)
