"""Cross-entropy statistics and the logits gradient of one loss chunk: the op `xent` and its
forms.

For logits `[..., V]` (upcast to float32), integer targets `[...]` and a per-position scale
`[...]`:

    top_idx, top = argmax, max over V (ties: the smallest index)
    lse          = log(sum(exp(logits)))                     (online: running max and sum)
    target       = logits[..., target]
    d_logits     = (softmax(logits) - onehot(target) + [L2Wrap: l2wrap * top at top_idx]) * scale

`xent(logits, targets, scale, *, l2wrap, grad_dtype, impl, platform, one_device)` runs:

    "xla"                  `xent_reference`: plain JAX, two XLA fusions: the statistics from
                           one variadic reduction (`max_argmax_logsumexp`), then the gradient
    "pallas" / "interpret" `xent_pallas`: one Pallas-Triton program per row ("interpret": in
                           the Pallas interpreter), on a device mesh too
    "auto"                 the kernel on one GPU when the vocabulary tiles (`vocab_block`),
                           else XLA's form

(`impl` is `train.loss.fused_lm_loss`'s `xent_impl`; the rule is `kernel_runs`, which is
`kernel_choice.kernel_chosen` for "auto" and "xla". Unlike the other ops', "pallas" on a device
mesh is no error: the kernel runs there, as the loss has always let it.)

The kernel's pass 1 reads a row block by block for the statistics; pass 2 reads it again, last
block first (the blocks pass 1 read last are the likeliest to still be in L2), and writes the
gradient in `grad_dtype`: the same bytes as the XLA form (two reads, one write) at a higher
bandwidth, measured by benchmarks/xent.py (the kernel alone) and benchmarks/train_step.py (the
step); figures in benchmarks/RESULTS-log.md ("the loss chunk's statistics and gradient in one
Pallas kernel"). A NaN or +inf logit makes the row's `lse` NaN and a target outside [0, V) its
`target` NaN, so the loss is NaN (as in the XLA form) and the step's non-finite guard skips it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lwm_jax.ops.kernel_choice import kernel_chosen

_F32 = jnp.float32
MAX_BLOCK = 4096      # logits per row read per loop step (16 KiB)
MIN_BLOCK = 2048      # smaller blocks (vocabularies like 32000 = 2^8 x 125) are not measured


def xent(logits, targets, scale, *, l2wrap: float | None, grad_dtype, impl: str = "xla",
         platform: str | None = None, one_device: bool = True):
    """Cross-entropy statistics and logits gradient over the last axis, as `impl` says.

    Args:
      logits: `[..., V]` any float dtype (upcast to float32).
      targets: integer `[...]`, token ids in [0, V) (one outside: its `target` is NaN).
      scale: float `[...]` (or broadcastable to it), each position's factor on `d_logits`
        (0 for a padded position).
      l2wrap: L2Wrap's factor, or None (no L2Wrap term).
      grad_dtype: the dtype `d_logits`' consumer rounds it to (in the loss: the head's
        backward products, the compute dtype). The kernel writes `d_logits` in it; the XLA
        form returns float32 and leaves that rounding to the consumer.
      impl: "xla" (default), "pallas", "interpret" or "auto" (see the module docstring).
      platform: "cpu" | "gpu" | "tpu", the platform the program is compiled for (None: JAX's
        default devices'; read by "auto" only).
      one_device: False on a device mesh: "auto" keeps XLA's form there ("pallas" still runs
        the kernel).
    Returns:
      `(lse, target, top, top_idx, d_logits)`: float32 `[...]` x 3, int32 `[...]`, and
      `[..., V]` in `grad_dtype` (kernel) or float32 (XLA form).
    """
    *lead, V = logits.shape
    if not kernel_runs(impl, V, platform=platform, one_device=one_device):
        return xent_reference(logits, targets, scale, l2wrap=l2wrap, grad_dtype=_F32)
    scale_N = jnp.broadcast_to(scale, targets.shape).reshape(-1)
    out = xent_pallas(logits.reshape(-1, V), targets.reshape(-1), scale_N, l2wrap=l2wrap,
                      grad_dtype=grad_dtype, interpret=impl == "interpret")
    return tuple(a.reshape(*lead, *a.shape[1:]) for a in out)


def kernel_runs(impl: str, V: int, *, platform: str | None, one_device: bool) -> bool:
    """Whether `xent` runs `xent_pallas` for a vocabulary of V logits. "pallas" / "interpret":
    always, on a device mesh too (a V that does not tile is then `xent_pallas`'s ValueError);
    "xla" and "auto": `kernel_chosen`'s rule ("auto": on one GPU when `vocab_block(V)` tiles
    it). An `impl` outside `kernel_choice.IMPLS` is a one-line ValueError."""
    if impl in ("pallas", "interpret"):
        return True
    return kernel_chosen("xent_impl", impl, per_device=one_device, platform=platform,
                         fits=vocab_block(V) is not None,
                         kernel="the Pallas cross-entropy (fused_lm_loss's xent_impl)",
                         needs=f"a vocabulary that is a multiple of {MIN_BLOCK}")


def vocab_block(V: int) -> int | None:
    """The largest power of two <= MAX_BLOCK dividing V, or None below MIN_BLOCK (the kernel
    then does not apply: `xent_pallas` raises, `xent`'s "auto" keeps the XLA form)."""
    block = MAX_BLOCK
    while block >= MIN_BLOCK:
        if V % block == 0:
            return block
        block //= 2
    return None


def _online_combine(a, b):
    """Merges two (max, index of the max, sum of exp(logit - max)) summaries of disjoint logit
    sets. One exp per merge: the smaller max's sum is rescaled to the larger max. Ties keep the
    smaller index (as `jnp.argmax`); a NaN max makes the sum NaN, so the loss stays NaN."""
    m_a, i_a, s_a = a
    m_b, i_b, s_b = b
    hi, lo = jnp.maximum(m_a, m_b), jnp.minimum(m_a, m_b)
    a_wins = (m_a > m_b) | ((m_a == m_b) & (i_a <= i_b))
    # equal maxima (two empty summaries at -inf included) rescale by exactly 1
    rescale = jnp.exp(jnp.where(hi == lo, 0.0, lo - hi))
    total = jnp.where(m_a >= m_b, s_a + s_b * rescale, s_a * rescale + s_b)
    return hi, jnp.where(a_wins, i_a, i_b), total


def max_argmax_logsumexp(logits_BnV: jax.Array):
    """`(argmax, max, logsumexp)` over the last axis in one reading of `logits_BnV` (float32).

    A variadic reduction carries each row's running max, its index and the sum of
    `exp(logit - running max)` (online softmax): it reads the logits once where `argmax` then
    `logsumexp` read them twice (the logits chunk is the largest array the loss touches,
    `[B, n, V]` float32; the step time it saves: benchmarks/train_step.py, figures in
    benchmarks/RESULTS-log.md, "the loss's reductions in one pass"). The vocabulary is
    reduced in two levels (blocks of a power of two near sqrt(V), the last one padded with
    -inf at weight 0, then the blocks' summaries), so no platform folds 65536 terms one after
    another: a sequential fold (XLA on a CPU) loses ~1e-6 of the log-sum-exp, two levels keep
    it at float32 rounding. Returns int32 `[B, n]`, float32 `[B, n]`, float32 `[B, n]`.
    """
    *lead, V = logits_BnV.shape
    block = 1 << max(0, (V.bit_length() - 1) // 2)     # the largest power of two <= sqrt(V)
    n_blocks = -(-V // block)
    pad = n_blocks * block - V                          # < block positions: -inf, weight 0
    logits = jnp.pad(logits_BnV, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf)
    index = jax.lax.broadcasted_iota(jnp.int32, (n_blocks * block,), 0)
    shape = (*lead, n_blocks, block)
    summary = (logits.reshape(shape), jnp.broadcast_to(index.reshape(n_blocks, block), shape),
               jnp.broadcast_to((index < V).astype(jnp.float32).reshape(n_blocks, block), shape))
    init = (jnp.float32(-jnp.inf), jnp.int32(0), jnp.float32(0))
    for axis in (len(shape) - 1, len(shape) - 2):     # within blocks, then across them
        summary = jax.lax.reduce(summary, init, _online_combine, (axis,))
    top, top_idx, sum_exp = summary
    return top_idx, top, top + jnp.log(sum_exp)


def xent_reference(logits_NV, targets_N, scale_N, *, l2wrap: float | None, grad_dtype):
    """Plain-JAX statistics and gradient over the last axis (any leading axes `...`: `xent`'s
    XLA form): `logits [..., V]`, `targets [...]`, `scale` broadcastable to `[...]`.
    Returns `(lse, target, top, top_idx, d_logits)`: float32 `[...]` x 3, int32 `[...]`,
    `[..., V]` in `grad_dtype`. `l2wrap`: L2Wrap's factor or None (no L2Wrap term)."""
    logits = logits_NV.astype(_F32)
    top_idx, top, lse = max_argmax_logsumexp(logits)
    target = jnp.take_along_axis(logits, targets_N[..., None], axis=-1)[..., 0]
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    d = jnp.exp(logits - lse[..., None]) - (ids == targets_N[..., None])
    if l2wrap is not None:
        d = d + jnp.where(ids == top_idx[..., None], (l2wrap * top)[..., None], 0.0)
    return lse, target, top, top_idx, (d * scale_N[..., None]).astype(grad_dtype)


def _kernel(x_ref, t_ref, s_ref, lse_ref, tgt_ref, top_ref, idx_ref, g_ref, *, V, block,
            l2wrap):
    """One row: x_ref `[V]` float32 logits, t_ref / s_ref `[1]` target and scale; writes the
    four statistics (`[1]` each) and g_ref `[V]`."""
    n_blocks = V // block
    iota = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)

    def stats(j, carry):
        m, s, idx = carry
        x = x_ref[pl.ds(j * block, block)]
        bm = jnp.max(x)
        bidx = jnp.min(jnp.where(x == bm, iota, block)) + j * block
        new_m = jnp.maximum(m, bm)
        s = s * jnp.exp(m - new_m) + jnp.sum(jnp.exp(x - new_m))
        return new_m, s, jnp.where(bm > m, bidx, idx)

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(0))
    top, total, top_idx = jax.lax.fori_loop(0, n_blocks, stats, init)
    lse = top + jnp.log(total)
    t = jnp.sum(t_ref[...])
    scale = jnp.sum(s_ref[...])

    def grad(i, _):
        j = n_blocks - 1 - i       # backwards: the blocks pass 1 read last are likeliest in L2
        x = x_ref[pl.ds(j * block, block)]
        ids = iota + j * block
        d = jnp.exp(x - lse) - jnp.where(ids == t, 1.0, 0.0)
        if l2wrap is not None:
            d = d + jnp.where(ids == top_idx, l2wrap * top, 0.0)
        g_ref[pl.ds(j * block, block)] = (d * scale).astype(g_ref.dtype)
        return 0

    jax.lax.fori_loop(0, n_blocks, grad, 0)
    lse_ref[...] = jnp.full((1,), lse, _F32)
    # a target outside [0, V) reads nothing and gives NaN (as the XLA form's gather does)
    in_range = (t >= 0) & (t < V)
    picked = jnp.sum(x_ref[pl.ds(jnp.clip(t, 0, V - 1), 1)])
    tgt_ref[...] = jnp.full((1,), jnp.where(in_range, picked, jnp.nan), _F32)
    top_ref[...] = jnp.full((1,), top, _F32)
    idx_ref[...] = jnp.full((1,), top_idx, jnp.int32)


@functools.partial(jax.jit, static_argnames=("l2wrap", "grad_dtype", "interpret", "num_warps",
                                             "block"))
def xent_pallas(logits_NV, targets_N, scale_N, *, l2wrap: float | None, grad_dtype,
                interpret: bool = False, num_warps: int = 8, block: int | None = None):
    """`xent_reference` as one Pallas-Triton program per row (see the module docstring). Same
    arguments and results; V must be a multiple of MIN_BLOCK (`vocab_block`).
    `num_warps`, `block` (logits per loop step, default `vocab_block(V)`): launch tuning."""
    N, V = logits_NV.shape
    block = block or vocab_block(V)
    if block is None or V % block:
        raise ValueError(f"xent_pallas: vocabulary size {V} is not a multiple of "
                         f"{block or MIN_BLOCK}; use xent_reference (loss: xent_impl='xla')")
    row = pl.BlockSpec((pl.squeezed, V), lambda i: (i, 0))
    one = pl.BlockSpec((1,), lambda i: (i,))
    kernel = functools.partial(_kernel, V=V, block=block, l2wrap=l2wrap)
    lse, target, top, top_idx, d = pl.pallas_call(
        kernel, grid=(N,), in_specs=[row, one, one], out_specs=[one, one, one, one, row],
        out_shape=[jax.ShapeDtypeStruct((N,), _F32), jax.ShapeDtypeStruct((N,), _F32),
                   jax.ShapeDtypeStruct((N,), _F32), jax.ShapeDtypeStruct((N,), jnp.int32),
                   jax.ShapeDtypeStruct((N, V), grad_dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret, name="xent_rows",
    )(logits_NV.astype(_F32), targets_N.astype(jnp.int32), scale_N.astype(_F32))
    return lse, target, top, top_idx, d
