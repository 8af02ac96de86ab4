"""The device mesh's axis names and how a `[B, T, ...]` activation is split over them: a leaf.

Every train step's mesh has the axes `MESH_AXES` (sizes from the run config's `mesh:`). Every
`[B, T, ...]` activation is split the same way: B over `data` and `fsdp` together, T over
`sequence`, any trailing dim whole; `tensor` splits parameters (vocabulary, hidden width,
heads). The ops (per-device kernels), layers (pinning), models and the trainer read the names
here, so none imports another for them.
"""
from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "sequence")
BATCH_AXES = ("data", "fsdp")     # mesh axes splitting B
SEQUENCE_AXIS = "sequence"        # mesh axis splitting T


def activation_spec(ndim: int = 2) -> P:
    """PartitionSpec of an activation of rank `ndim` (>= 2) whose first two dims are [B, T]."""
    return P(BATCH_AXES, SEQUENCE_AXIS, *(None,) * (ndim - 2))


def tokens_per_device(mesh, B: int, T: int) -> tuple[int, int] | None:
    """`(B, T)` each device holds of a `[B, T, ...]` activation when the mesh splits tokens
    only: every axis of size > 1 is a batch or the sequence axis, and B and T divide evenly.
    None otherwise (a `tensor` axis, an uneven split). `mesh` None: `(B, T)`."""
    if mesh is None:
        return B, T
    shape = dict(mesh.shape)
    if any(size > 1 for axis, size in shape.items()
           if axis not in BATCH_AXES and axis != SEQUENCE_AXIS):
        return None
    nb = math.prod(shape.get(a, 1) for a in BATCH_AXES)
    ns = shape.get(SEQUENCE_AXIS, 1)
    if B % nb or T % ns:
        return None
    return B // nb, T // ns
