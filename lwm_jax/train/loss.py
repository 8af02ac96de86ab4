"""Language-model loss: float32 cross-entropy and RWKV-LM's L2Wrap.

L2Wrap leaves the loss value unchanged and, in the backward pass, adds
`max_logit * 1e-4 / (B*T)` to the gradient of each position's largest logit. It discourages the
logits from drifting upwards (RWKV-LM uses it in every run). The extra gradient is multiplied by
the loss's incoming cotangent, so loss scaling (fp16) and micro-batch averaging treat it exactly
like a term of the loss.

`fused_lm_loss` computes the same loss (and L2Wrap) chunk by chunk from the final hidden states,
with the gradient taken in the forward pass, so `[B, T, V]` logits never exist.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lwm_jax.hardware import platform_of
from lwm_jax.mesh_axes import BATCH_AXES, SEQUENCE_AXIS
from lwm_jax.ops.xent import xent

L2WRAP_FACTOR = 1e-4


@jax.named_scope("loss")
def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats (float32 scalar).

    logits_BTV: any float dtype, upcast to float32 before the logsumexp.
    targets_BT: int token ids in [0, V).
    """
    logits = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits, targets_BT[..., None].astype(jnp.int32),
                                          axis=-1)[..., 0]
    return jnp.mean(lse_BT - target_logit_BT)


@jax.custom_vjp
def l2wrap(loss: jax.Array, logits_BTV: jax.Array) -> jax.Array:
    """Identity on `loss`; its VJP adds the L2Wrap gradient to `logits_BTV` (see module doc)."""
    del logits_BTV
    return loss


def _l2wrap_fwd(loss, logits_BTV):
    idx_BT = jnp.argmax(logits_BTV, axis=-1)
    max_BT = jnp.max(logits_BTV, axis=-1).astype(jnp.float32)
    # Residuals must be arrays: an empty [0, V] array carries the vocabulary size and dtype.
    proto_0V = jnp.zeros((0, logits_BTV.shape[-1]), logits_BTV.dtype)
    return loss, (idx_BT, max_BT, proto_0V)


def _l2wrap_bwd(res, g):
    idx_BT, max_BT, proto_0V = res
    vocab, dtype = proto_0V.shape[1], proto_0V.dtype
    n_positions = max_BT.size                                    # B*T
    value_BT = max_BT * (L2WRAP_FACTOR / n_positions) * g.astype(jnp.float32)
    grad_BTV = jax.nn.one_hot(idx_BT, vocab, dtype=jnp.float32) * value_BT[..., None]
    return g, grad_BTV.astype(dtype)


l2wrap.defvjp(_l2wrap_fwd, _l2wrap_bwd)


def lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, *, use_l2wrap: bool) -> jax.Array:
    """Cross-entropy (float32 scalar), with L2Wrap's extra gradient when `use_l2wrap`."""
    loss = cross_entropy(logits_BTV, targets_BT)
    return l2wrap(loss, logits_BTV) if use_l2wrap else loss


def fused_lm_loss(head_fn: Callable, x_BTC: jax.Array, head_params: Any, targets_BT: jax.Array,
                  *, chunk_tokens: int, use_l2wrap: bool, mesh=None,
                  xent_impl: str = "auto", platform: str | None = None) -> jax.Array:
    """`lm_loss(head_fn(x, head_params), targets)` without ever holding `[B, T, V]` logits.

    The positions are cut into the fewest chunks of at most `chunk_tokens` tokens (at most
    `max(1, chunk_tokens // B)` positions of every row, as even as can be), strided: chunk i
    holds positions i, i + NC, ... where NC is the number of chunks, so a time axis sharded
    over devices stays sharded. A `lax.scan` computes each chunk's float32 logits, its share of
    the mean cross-entropy and, right away, the gradient of that share (softmax minus one-hot, plus
    L2Wrap's term at the argmax) pulled back to `x` and `head_params`. The forward therefore
    keeps `d x` (`[B, T, C]` float32) and the head gradient, and the backward only scales
    them by the incoming cotangent: no logits are recomputed and none outlive their chunk.

    Args:
      head_fn: `head_fn(x_BnC, head_params) -> logits_BnV` float32 (e.g. final norm + head).
      x_BTC: final hidden states. head_params: pytree of the head's arrays.
      targets_BT: int token ids in [0, V).
      chunk_tokens: tokens per chunk, summed over the rows (>= 1).
      use_l2wrap: add L2Wrap's gradient (the loss value is unchanged).
      mesh: the device mesh the step runs on, or None. With B or T split over devices each
        device sums its own tokens' head gradient across the chunks (`_DeviceGroups`).
      xent_impl: the `impl` of `lwm_jax.ops.xent.xent`, which computes each chunk's
        statistics and logits gradient: "xla", "pallas", "interpret" or "auto" (that op's
        docstring says which form each runs; a value outside these is its ValueError).
      platform: the platform the step is compiled for (read by "auto"; None: the mesh's
        devices', or JAX's default devices' without a mesh).
    Returns:
      float32 scalar, the mean cross-entropy in nats (equal to `lm_loss` up to summation order).
    """
    platform = platform or platform_of(mesh)
    return _fused(head_fn, chunk_tokens, use_l2wrap, mesh, xent_impl, platform, x_BTC,
                  head_params, targets_BT)


def chunked_cross_entropy(head_fn: Callable, x_BTC: jax.Array, head_params: Any,
                          targets_BT: jax.Array, *, chunk_tokens: int, mesh=None) -> jax.Array:
    """Mean cross-entropy (float32, nats) of `head_fn(x, head_params)` computed chunk by chunk
    (as `fused_lm_loss`, without gradients: for evaluation)."""
    return _fused_forward(head_fn, chunk_tokens, False, mesh, "xla", None, x_BTC, head_params,
                          targets_BT, with_grad=False)[0]


class _DeviceGroups:
    """The chunks' tokens grouped by the device that holds them, for a multi-device mesh.

    Inside the chunk loop a head gradient summed over a chunk's `B x n` tokens spans every
    device's tokens, so XLA reduced it across devices once per chunk (and, with the head's
    parameters split over `fsdp`, gathered them once per chunk too): most of a multi-device
    step's exposed collective time (measured by tools/device_scaleout.sh with
    benchmarks/train_step.py; figures in benchmarks/RESULTS-log.md, "the fused loss's
    per-device accumulators").
    Viewed as `[G, B/Gb, n/Gs, ...]` (G = Gb x Gs: Gb devices along B over `data` x `fsdp`, Gs
    along T over `sequence`; chunk positions are strided, so each device's share of a chunk is
    a contiguous `n/Gs` block), the loop keeps one gradient accumulator per group, each on its
    own device, and the G accumulators are summed once after the loop. The head's parameters
    are gathered once before it, and each device holds one float32 head-sized accumulator
    (under FSDP: the whole head's, not its 1/N share). Used only when the shapes split evenly,
    the mesh has no `tensor` axis (the head's vocabulary would be split) and the chunks hold no
    padding; otherwise `active` is False and the loop runs as on one device.
    """

    def __init__(self, mesh, B: int, n: int, pad: int):
        size = (lambda a: mesh.shape.get(a, 1)) if mesh is not None else (lambda a: 1)
        self.gb = math.prod(size(a) for a in BATCH_AXES)
        self.gs = size(SEQUENCE_AXIS)
        self.g = self.gb * self.gs
        self.active = (mesh is not None and self.g > 1 and size("tensor") == 1 and pad == 0
                       and B % self.gb == 0 and n % self.gs == 0)
        if self.active:
            axes = (*BATCH_AXES, SEQUENCE_AXIS)
            self.by_chunk = NamedSharding(mesh, P(None, axes))   # [NC, G, ...]
            self.by_group = NamedSharding(mesh, P(axes))         # [G, ...]
            self.whole = NamedSharding(mesh, P())

    def split(self, a):
        """`[NC, B, n, ...]` -> `[NC, G, B/Gb, n/Gs, ...]`, G on its devices."""
        NC, B, n = a.shape[:3]
        a = a.reshape(NC, self.gb, B // self.gb, self.gs, n // self.gs, *a.shape[3:])
        a = jnp.swapaxes(a, 2, 3).reshape(NC, self.g, B // self.gb, n // self.gs, *a.shape[5:])
        return jax.lax.with_sharding_constraint(a, self.by_chunk)

    def merge(self, a):
        """Inverse of `split`."""
        NC, _, b, m = a.shape[:4]
        a = a.reshape(NC, self.gb, self.gs, b, m, *a.shape[4:])
        return jnp.swapaxes(a, 2, 3).reshape(NC, self.gb * b, self.gs * m, *a.shape[5:])


@jax.named_scope("loss")
def _fused_forward(head_fn, chunk_tokens, use_l2wrap, mesh, xent_impl, platform, x_BTC,
                   head_params, targets_BT, with_grad=True):
    B, T, C = x_BTC.shape
    NC = -(-T // max(1, min(T, chunk_tokens // B)))   # chunks of at most chunk_tokens // B
    n = -(-T // NC)                                    # positions per chunk, evened out:
    pad = NC * n - T                                   # fewer than NC padded positions
    x_pad = jnp.pad(x_BTC, ((0, 0), (0, pad), (0, 0)))
    tgt_pad = jnp.pad(targets_BT.astype(jnp.int32), ((0, 0), (0, pad)))
    valid = (jnp.arange(NC * n) < T).astype(jnp.float32)
    # chunk i holds positions i, i + NC, i + 2 NC, ... of every row (strided, not contiguous):
    # when T is sharded over devices (sequence parallelism) each chunk then has tokens on every
    # device, and each device runs its own share of every chunk instead of all gathering x
    by_chunk = lambda a: jnp.moveaxis(a.reshape(a.shape[0], n, NC, *a.shape[2:]), 2, 0)  # noqa
    inv_total = 1.0 / (B * T)
    groups = _DeviceGroups(mesh, B, n, pad)
    one_device = mesh is None or mesh.size == 1

    def chunk(x_BnC, tgt_Bn, valid_n, head_params):
        """One chunk's (loss share, dx, head gradient) at unit scale (see below)."""
        logits_BnV, pullback = jax.vjp(lambda x, p: head_fn(x, p), x_BnC, head_params)
        logits_BnV = logits_BnV.astype(jnp.float32)
        weight_Bn = valid_n[None, :] * inv_total
        scale_Bn = jnp.broadcast_to(valid_n[None, :], tgt_Bn.shape)
        # grad_dtype: what the head's backward products round the cotangent to (x's: the
        # compute dtype); a narrower d_logits is widened for the pullback below, so the same
        # bits reach the products. Without gradients the XLA form (its unused d_logits is
        # dropped by XLA; the kernel would write it)
        lse_Bn, target_Bn, _, _, d_logits = xent(
            logits_BnV, tgt_Bn, scale_Bn, l2wrap=L2WRAP_FACTOR if use_l2wrap else None,
            grad_dtype=x_BnC.dtype, impl=xent_impl if with_grad else "xla", platform=platform,
            one_device=one_device)
        loss_part = jnp.sum((lse_Bn - target_Bn) * weight_Bn)
        if not with_grad:
            return loss_part, None, None
        # pulled back at unit scale (each position's d_logits in [-1, 1] plus L2Wrap's term),
        # the 1 / (B T) of the mean applied after in float32: the head's gradient products
        # take 16-bit operands under a 16-bit policy, where 1e-5-sized cotangents would
        # lose their bits (fp16) to the scale alone
        dx_BnC, d_p = pullback(d_logits.astype(jnp.float32))
        return loss_part, dx_BnC.astype(jnp.float32), jax.tree.map(
            lambda a: a.astype(jnp.float32), d_p)

    xs = (by_chunk(x_pad), by_chunk(tgt_pad), valid.reshape(n, NC).T)
    lead = ()
    if groups.active:    # per-device groups: one accumulator each, head gathered once
        head_params = jax.tree.map(
            lambda a: jax.lax.with_sharding_constraint(a, groups.whole), head_params)
        valid_G = jnp.tile(xs[2].reshape(NC, 1, groups.gs, n // groups.gs),
                           (1, groups.gb, 1, 1)).reshape(NC, groups.g, n // groups.gs)
        xs = (groups.split(xs[0]), groups.split(xs[1]), valid_G)
        chunk = jax.vmap(chunk, in_axes=(0, 0, 0, None))
        lead = (groups.g,)

    def body(carry, xs):
        loss_sum, d_head = carry
        loss_part, dx, d_p = chunk(*xs, head_params)
        loss_sum = loss_sum + loss_part          # per group while grouped: summed after
        if with_grad:
            d_head = jax.tree.map(jnp.add, d_head, d_p)
        return (loss_sum, d_head), dx

    zeros = (jnp.zeros(lead, jnp.float32),
             jax.tree.map(lambda p: jnp.zeros((*lead, *p.shape), jnp.float32), head_params))
    if groups.active:
        zeros = jax.tree.map(lambda z: jax.lax.with_sharding_constraint(z, groups.by_group),
                             zeros)
    (loss, d_head), dx = jax.lax.scan(body, zeros, xs)
    loss = jnp.sum(loss)
    if not with_grad:
        return loss, None
    if groups.active:
        dx = groups.merge(dx)
        d_head = jax.tree.map(lambda d: jnp.sum(d, axis=0), d_head)
    dx_BTC = jnp.moveaxis(dx, 0, 2).reshape(B, NC * n, C)[:, :T] * inv_total
    d_head = jax.tree.map(lambda d: d * inv_total, d_head)
    return loss, (dx_BTC, d_head)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _fused(head_fn, chunk_tokens, use_l2wrap, mesh, xent_impl, platform, x_BTC, head_params,
           targets_BT):
    return _fused_forward(head_fn, chunk_tokens, use_l2wrap, mesh, xent_impl, platform, x_BTC,
                          head_params, targets_BT)[0]


def _fused_fwd(head_fn, chunk_tokens, use_l2wrap, mesh, xent_impl, platform, x_BTC,
               head_params, targets_BT):
    loss, grads = _fused_forward(head_fn, chunk_tokens, use_l2wrap, mesh, xent_impl, platform,
                                 x_BTC, head_params, targets_BT)
    protos = jax.tree.map(lambda p: jnp.zeros((0,), p.dtype), (x_BTC, head_params))  # dtypes
    return loss, (grads, protos, targets_BT)


def _fused_bwd(head_fn, chunk_tokens, use_l2wrap, mesh, xent_impl, platform, res, g):
    # the gradients are kept in float32 and scaled by the cotangent (a loss scale under
    # fp16-mixed) before they are cast to their operands' dtypes
    (dx_BTC, d_head), (x_proto, protos), targets_BT = res
    g = g.astype(jnp.float32)
    dx = (dx_BTC * g).astype(x_proto.dtype)
    d_head = jax.tree.map(lambda d, proto: (d * g).astype(proto.dtype), d_head, protos)
    return dx, d_head, np.zeros(targets_BT.shape, jax.dtypes.float0)


_fused.defvjp(_fused_fwd, _fused_bwd)
