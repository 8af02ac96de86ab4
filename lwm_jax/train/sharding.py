"""Device mesh and the mapping from parameter logical axes to mesh axes.

Mesh axes, outermost first: `data` (pure data parallel: params replicated), `fsdp` (data parallel
with parameters and optimizer state sharded over it, ZeRO-3 style), `tensor` (model parallel
over heads / mlp / vocab), `sequence` (the time axis of activations). A laptop gets a 1x1x1x1
mesh and every sharding below degenerates to "replicated on the one device".

Logical-axis rules (`LOGICAL_RULES`): a parameter dim named `embed` is split over `fsdp`;
`vocab`, `mlp` and `heads` over `tensor`; `layers`, `head_dim` and `lora` stay whole. A mesh
axis is used at most once per array, and a dim whose size is not divisible by the mesh axis size
stays replicated (so odd shapes still run, just less sharded).
The batch `[B, T]` is split over (`data`, `fsdp`) on B and `sequence` on T
(`lwm_jax.layers.layout`, where the models read it too).
"""
from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lwm_jax.mesh_axes import BATCH_AXES, MESH_AXES
from lwm_jax.train.params import map_with_names

LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "head_dim": None,
    "lora": None,
    "layers": None,
}


def make_mesh(sizes: dict[str, int], devices: list | None = None) -> Mesh:
    """A `Mesh` with axes `MESH_AXES` of the given sizes (product = number of devices).

    Devices are ordered by `jax.make_mesh` (interconnect-aware on TPU/GPU); all axes are
    `Auto` (GSPMD propagates shardings between the explicit in/out shardings). Devices of
    several TPU slices (multi-slice: each device's `slice_index`) put the slices on the `data`
    axis, the only one whose traffic (one gradient all-reduce per step) suits the slower
    data-center network (DCN) between slices; every other axis stays inside a slice's ICI.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh: axis sizes {dict(zip(MESH_AXES, shape))} need "
                         f"{math.prod(shape)} devices, {len(devices)} given")
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    slices = num_slices(devices)
    if slices == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    if sizes["data"] % slices:
        raise ValueError(f"mesh.data: {sizes['data']} is not a multiple of the {slices} slices "
                         "(the data axis spans the slices over DCN); set mesh.data to a "
                         f"multiple of {slices}, e.g. mesh.data={slices} and mesh.fsdp=-1")
    from jax.experimental import mesh_utils
    ici = (sizes["data"] // slices, *shape[1:])
    dcn = (slices,) + (1,) * (len(MESH_AXES) - 1)
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def num_slices(devices: list) -> int:
    """How many TPU slices `devices` span (their distinct `slice_index`; 1 without one)."""
    return len({getattr(d, "slice_index", 0) or 0 for d in devices})


def logical_to_spec(logical_axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec for one array from its logical axis names (see module doc)."""
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical_axes, shape):
        if name is not None and name not in LOGICAL_RULES:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: "
                             f"{', '.join(LOGICAL_RULES)}")
        axis = LOGICAL_RULES.get(name) if name is not None else None
        if axis is None or axis in used or mesh.shape[axis] == 1 or dim % mesh.shape[axis]:
            spec.append(None)
        else:
            used.add(axis)
            spec.append(axis)
    return P(*spec)


def param_shardings(params: Any, axes_by_name: dict[str, tuple], mesh: Mesh) -> Any:
    """Pytree of `NamedSharding` matching `params` (arrays or ShapeDtypeStructs)."""
    return map_with_names(
        lambda n, x: NamedSharding(mesh, logical_to_spec(axes_by_name[n], x.shape, mesh)), params)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def tokens_sharding(mesh: Mesh, with_accum_axis: bool = False) -> NamedSharding:
    """Sharding of a host batch of token ids `[B, T+1]` (or `[A, B/A, T+1]` with accumulation).

    Only the batch dim is split: T+1 need not divide the `sequence` axis. The step constrains
    the `[B, T]` inputs to `lwm_jax.layers.layout.activation_spec()` after slicing.
    """
    spec = P(None, BATCH_AXES, None) if with_accum_axis else P(BATCH_AXES, None)
    return NamedSharding(mesh, spec)


def shard_like_params(tree: Any, params: Any, param_sh: Any, mesh: Mesh) -> Any:
    """Shardings for a tree (e.g. optimizer state) whose sub-trees mirror `params`.

    Every sub-tree with the same structure as `params` (Adam moments) gets the parameter
    shardings; every other leaf (step counters, scalars) is replicated.
    """
    params_def = jax.tree.structure(params)

    def is_param_like(x):
        return jax.tree.structure(x) == params_def

    return jax.tree.map(lambda x: param_sh if is_param_like(x) else replicated(mesh),
                        tree, is_leaf=is_param_like)
