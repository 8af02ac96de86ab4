"""The activations' layout on a device mesh, and pinning a tensor to it.

Every `[B, T, ...]` activation of a train step is split the same way (`lwm_jax.mesh_axes`: B
over `data` and `fsdp` together, T over `sequence`); `pin_activation` holds a layer's output to
that layout.

Why pin: with parameters split over `fsdp` (ZeRO-3) a matmul `x[B/f, T, C] @ W[C/f, F]` can be
partitioned two ways, and XLA's sharding propagation does not always take the cheap one (gather
W, a few MB) over the costly one (move `x`, a few hundred MB). In the layer loop without
`lax.scan` it chose the costly one for the 0.1B RWKV-7 on two H200s (`mesh.fsdp=2`): the
channel-mix activations and the `[B, T, V]` logits were all-gathered and reduce-scattered,
and the step ran far slower than data-parallel (`benchmarks/train_step.py`; figures in
benchmarks/RESULTS-log.md). A constraint on the residual stream at every layer boundary leaves
only the first way.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding

from lwm_jax.mesh_axes import BATCH_AXES, SEQUENCE_AXIS, activation_spec


def pin_activation(x, mesh):
    """`x` (`[B, T, ...]`, any dtype) constrained to the activations' layout on `mesh`.

    The identity when `mesh` is None or one device, for `x` None (a value a layer has not made
    yet), and when B or T does not split evenly over its axes (decoding a few rows or tokens:
    propagation decides). Values and gradients are unchanged; only where XLA keeps the data is
    fixed.
    """
    if x is None or mesh is None or mesh.size == 1:
        return x
    size = lambda axes: math.prod(mesh.shape.get(a, 1) for a in axes)  # noqa: E731
    if x.shape[0] % size(BATCH_AXES) or x.shape[1] % size((SEQUENCE_AXIS,)):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, activation_spec(x.ndim)))
