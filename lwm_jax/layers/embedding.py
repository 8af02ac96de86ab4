"""Token embedding lookup whose gradient is reduced by gathering tokens, not the table.

The gradient of a lookup `table_VC[tokens_BT]` is a scatter-add of the output cotangent into a
`[V, C]` zero table. Under data parallelism each device scatters its own tokens and the dense
`[V, C]` float32 partial tables are then all-reduced: at V = 65536, C = 2048 that is 0.5 GB per
step, and it is the last gradient of the backward pass (the embedding is the first layer), so
nothing overlaps it. When the mesh holds the table whole on every device and the batch's tokens
are fewer than twice the vocabulary, it is cheaper to all-gather the `[N, C]` cotangents and the
token ids (N = B * T over all devices) and let every device scatter all of them: a ring
all-reduce moves `2 (n-1)/n * V * C` values per device, an all-gather `(n-1)/n * N * C`.

The forward is `jnp.take` either way (out-of-range ids give NaN rows, its "fill" mode), and the
backward is `jnp.take`'s own transpose, so both paths give the same gradient up to the order of
float32 additions of repeated tokens. The gathers run in a `shard_map` over the activations'
layout (B over `data` x `fsdp`, T over `sequence`), named `GATHER_SCOPE` in the HLO metadata.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lwm_jax.mesh_axes import BATCH_AXES, SEQUENCE_AXIS, activation_spec

GATHER_SCOPE = "embedding_grad_gather"    # names the backward's gathers in HLO metadata


def gathers_gradient(mesh, shape_BT: tuple[int, int], vocab_size: int) -> bool:
    """Whether `embedding_lookup` reduces its gradient by gathering (see the module docstring).

    True when `mesh` spans several devices, keeps the table replicated (its `fsdp` and `tensor`
    axes are 1: otherwise the table's gradient is reduce-scattered, already a fraction of an
    all-reduce), the tokens `[B, T]` split evenly into the activations' layout, and B * T is
    below `2 * vocab_size`.
    """
    if mesh is None or mesh.size == 1:
        return False
    size = lambda axis: mesh.shape.get(axis, 1)  # noqa: E731
    if size("fsdp") > 1 or size("tensor") > 1:
        return False
    B, T = shape_BT
    if B % (size("data") * size("fsdp")) or T % size(SEQUENCE_AXIS):
        return False
    return B * T < 2 * vocab_size


def embedding_lookup(table_VC, tokens_BT, mesh=None):
    """Rows of `table_VC` `[V, C]` (any float dtype) at `tokens_BT` `[B, T]` (integer):
    `[B, T, C]` in the table's dtype. `mesh`: the device mesh the step runs on, or None; it only
    chooses how the table's gradient is reduced across devices (`gathers_gradient`)."""
    if not gathers_gradient(mesh, tuple(tokens_BT.shape), table_VC.shape[0]):
        return jnp.take(table_VC, tokens_BT, axis=0)
    return _lookup_gathered_grad(mesh, table_VC, tokens_BT)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup_gathered_grad(mesh, table_VC, tokens_BT):
    return jnp.take(table_VC, tokens_BT, axis=0)


def _lookup_fwd(mesh, table_VC, tokens_BT):
    # the table is a parameter, alive through the step anyway: keeping it costs no memory
    return jnp.take(table_VC, tokens_BT, axis=0), (tokens_BT, table_VC)


def _lookup_bwd(mesh, residuals, g_BTC):
    tokens_BT, table_VC = residuals
    axes = tuple(a for a in (*BATCH_AXES, SEQUENCE_AXIS) if mesh.shape.get(a, 1) > 1)
    layout = activation_spec()

    def scatter_all(tokens_bt, g_btc, table):
        # every device receives every token's id and cotangent, then scatters all of them:
        # the table's gradient comes out whole on each device, with no reduction of its own
        ids_N = jax.lax.all_gather(tokens_bt.reshape(-1), axes, tiled=True)
        g_NC = jax.lax.all_gather(g_btc.reshape(-1, g_btc.shape[-1]), axes, tiled=True)
        _, transpose = jax.vjp(lambda t: jnp.take(t, ids_N, axis=0), table)
        return transpose(g_NC.astype(table.dtype))[0]

    # check_vma=False: the gathered ids and cotangents are equal on every device, but the
    # varying-axes check would still count them as varying and have `jax.vjp`'s transpose
    # sum the (already whole) table gradient over the devices once more
    with jax.named_scope(GATHER_SCOPE):
        gathered = jax.shard_map(scatter_all, mesh=mesh, in_specs=(layout, layout, P()),
                                 out_specs=P(), check_vma=False)
        d_table = gathered(tokens_BT, g_BTC, table_VC)
    return d_table, None


_lookup_gathered_grad.defvjp(_lookup_fwd, _lookup_bwd)
