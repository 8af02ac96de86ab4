"""Sequence parallelism for WKV7: the time axis T sharded over one mesh axis.

Each of the n devices of the mesh axis `axis` holds a contiguous slice of `T / n` tokens. The
WKV7 state after a slice is affine in the state X before it: per head, for a slice position t,

    S_t = S_t^loc + Phi_t X,        o_t = o_t^loc + X^T q_t,      q_t = Phi_t^T r_t,

where `S^loc`, `o^loc` are the slice's state and output from a zero start and `Phi_t` (K x K)
is the product of the per-token transitions `A_s = diag(exp(w_s)) + b_s a_s^T` from the slice
start to t. A document reset inside the slice makes `Phi` zero from there on. So:

1. every device runs the ordinary `wkv7` (any implementation) on its slice from a zero state:
   local outputs `o^loc` and final state `D = S^loc_end`;
2. the same op with v = 0 and initial state I_K ("V" = K) gives `q_t` as its outputs and
   `M = Phi_end` as its final state (the identity is replaced by zeros in a batch row whose first
   slice token starts a new document: that slice ignores everything before it). On the pure-JAX
   implementations both runs are one call with v and the identity concatenated along the value
   axis (`[v | 0]`, initial state `[0 | I]`), so the intra-chunk decays and triangular solve,
   which depend only on r, w, k, a, b, are computed once; the Pallas GPU kernels get the same
   sharing from one custom_vjp (`pallas_gpu/pair.py`: one `intra_fwd`, two sequential passes);
3. all devices all-gather every slice's `(M, D)` along `axis` and compose the prefix
   `X_0 = initial_state`, `X_{d+1} = M_d X_d + D_d`;
4. device d corrects its outputs with its `X_d`; the global final state is `X_n`.

Gradients (to r, w, k, v, a, b and initial_state) are JAX autodiff of these steps: the
per-device op's own gradients and the transposes of the collectives (all_gather ->
reduce-scatter; the ppermute of `shift_across_slices` -> a ppermute back to the previous device).

Communication per call (forward; the backward moves the same amounts back), per device:
one all_gather of `B_loc * H_loc * K * (K + V)` float32 values from each of the n devices, and,
with segment ids, one ppermute of `B_loc` int32 ids (each slice's last id to the next device).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lwm_jax.hardware import platform_of
from lwm_jax.ops.wkv7.contract import check_wkv7_inputs, resolve_output_dtype
from lwm_jax.ops.wkv7.contract import PRECISIONS, xla_precision
from lwm_jax.ops.wkv7.dispatch import IMPLS, _resolve_impl, wkv7

DEFAULT_BATCH_AXES = ("data", "fsdp")


def _shard_map(f, *, mesh, in_specs, out_specs, check_vma):
    """`jax.shard_map` (jax >= 0.7), or the experimental one of older versions."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check_vma)
    from jax.experimental.shard_map import shard_map  # pragma: no cover - old jax only
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


def _pallas_pair(value_width: int, platform: str | None):
    """`wkv7_pallas_pair` bound to `platform` where it applies (GPU kernels, or their CPU
    interpreter; V <= 64), else None."""
    from lwm_jax.ops.wkv7.pallas import pallas_pair_applies, wkv7_pallas_pair
    if not pallas_pair_applies(value_width, platform=platform):
        return None
    return functools.partial(wkv7_pallas_pair, platform=platform)


def _axis_size(axis: str) -> int:
    """Static size of a manual mesh axis (inside `shard_map`)."""
    if hasattr(jax.lax, "axis_size"):
        return int(jax.lax.axis_size(axis))
    return int(jax.lax.psum(1, axis))  # pragma: no cover - old jax only


def _vma(x) -> frozenset:
    """Mesh axes along which `x` varies inside `shard_map` (its "varying manual axes"; jax 0.7
    to 0.9 call them `aval.vma`, jax >= 0.10 `aval.manual_axis_type.varying`)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()) or ())


def _vary_like(x, *refs):
    """`x` marked as varying over every mesh axis any of `refs` varies over (a no-op on values;
    needed so scan carries and collectives see consistent types under `shard_map`)."""
    missing = tuple(sorted(set().union(*(_vma(r) for r in refs)) - _vma(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # pragma: no cover - jax versions before pcast


def _previous_slice_last(x_B, axis: str, n: int):
    """Inside `shard_map`: the previous device's `x_B` along `axis` (zeros on device 0)."""
    if n == 1:
        return jnp.zeros_like(x_B)
    return jax.lax.ppermute(x_B, axis, perm=[(i, i + 1) for i in range(n - 1)])


def slice_starts_document(segment_ids_BT, axis: str):
    """Inside `shard_map` over `axis` (T sharded): `[B]` bool, True where this slice's first
    token starts a new document, i.e. its id differs from the previous device's last id.
    Always False on device 0 (position 0 continues from the caller's state).

    Communication: one ppermute of `B_loc` int32 values to the next device.
    """
    n = _axis_size(axis)
    first = segment_ids_BT[:, 0]
    prev_last = _previous_slice_last(segment_ids_BT[:, -1], axis, n)
    return (first != prev_last) & (jax.lax.axis_index(axis) > 0)


def shift_across_slices(x_BTC, axis: str, *, first_BC=None, segment_ids_BT=None):
    """Token shift with T sharded over `axis`: the previous token's `x` at every position.

    Call inside `shard_map` (each device holds the slice `x_BTC [B_loc, T/n, C]` of the global
    `[B, T, C]`). Position 0 of a slice gets the previous device's last token (sent by one
    `ppermute` of `[B_loc, C]` values); position 0 of device 0 gets `first_BC` (the carried
    token shift state, `[B_loc, C]`, any float dtype) or zeros. With `segment_ids_BT`
    (int `[B_loc, T/n]`, the local slice), positions that start a new document see zeros, as in
    `lwm_jax.layers.token_shift`, including a document starting at a slice's first token (one
    more ppermute of `B_loc` int32 ids).

    Returns `[B_loc, T/n, C]` in x's dtype.
    """
    n = _axis_size(axis)
    prev_BC = _previous_slice_last(x_BTC[:, -1], axis, n)
    if first_BC is not None:
        first_BC = _vary_like(first_BC.astype(x_BTC.dtype), prev_BC)
        prev_BC = jnp.where(jax.lax.axis_index(axis) == 0, first_BC, prev_BC)
    shifted = jnp.concatenate([prev_BC[:, None], x_BTC[:, :-1]], axis=1)
    if segment_ids_BT is not None:
        seg = jnp.asarray(segment_ids_BT)
        changed = jnp.concatenate([slice_starts_document(seg, axis)[:, None],
                                   seg[:, 1:] != seg[:, :-1]], axis=1)
        shifted = jnp.where(changed[..., None], jnp.zeros_like(shifted), shifted)
    return shifted


def _check_options(mesh, axis, batch_axes, head_axis, shape_BTHK, impl, chunk_size,
                   output_dtype, precision, v_dtype):
    """One-line errors for the sharding options; returns `(n, batch_axes, output dtype)`."""
    names = tuple(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"wkv7_sequence_parallel: axis {axis!r} is not a mesh axis; mesh axes: "
                         f"{names}")
    B, T, H, _ = shape_BTHK
    n = mesh.shape[axis]
    if T % n:
        raise ValueError(f"wkv7_sequence_parallel: T={T} must be divisible by the size {n} of "
                         f"mesh axis {axis!r}")
    if batch_axes is None:
        batch_axes = tuple(a for a in DEFAULT_BATCH_AXES if a in names)
    batch_axes = tuple(batch_axes)
    used = [axis, *batch_axes] + ([head_axis] if head_axis is not None else [])
    for a in used:
        if a not in names:
            raise ValueError(f"wkv7_sequence_parallel: {a!r} is not a mesh axis; mesh axes: "
                             f"{names}")
    if len(set(used)) != len(used):
        raise ValueError(f"wkv7_sequence_parallel: a mesh axis is used twice in axis={axis!r}, "
                         f"batch_axes={batch_axes}, head_axis={head_axis!r}")
    nb = math.prod(mesh.shape[a] for a in batch_axes)
    if B % nb:
        raise ValueError(f"wkv7_sequence_parallel: batch B={B} must be divisible by the "
                         f"{nb} devices of batch axes {batch_axes}")
    if head_axis is not None and H % mesh.shape[head_axis]:
        raise ValueError(f"wkv7_sequence_parallel: heads H={H} must be divisible by the size "
                         f"{mesh.shape[head_axis]} of mesh axis {head_axis!r}")
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"wkv7_sequence_parallel: impl must be one of {IMPLS}, got {impl!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"wkv7_sequence_parallel: chunk_size must be None or an int >= 1, got "
                         f"{chunk_size!r}")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"wkv7_sequence_parallel: precision must be None or one of "
                         f"{PRECISIONS}, got {precision!r}")
    return n, batch_axes, resolve_output_dtype(output_dtype, v_dtype, "wkv7_sequence_parallel")


def wkv7_sequence_parallel_local(r, w, k, v, a, b, *, axis, initial_state=None,
                                 segment_ids=None, impl="auto", chunk_size=None,
                                 output_dtype=None, precision=None, fuse=None, platform=None):
    """Per-device body of `wkv7_sequence_parallel`; call it inside `shard_map` over `axis`.

    Every argument is this device's block: r, w, k, a, b `[B_loc, T/n, H_loc, K]`, v
    `[B_loc, T/n, H_loc, V]`, segment_ids int `[B_loc, T/n]` or None (slice d holds global
    positions `[d T/n, (d+1) T/n)` of the global row), initial_state `[B_loc, H_loc, K, V]`
    (the state before global position 0, the same on every device of `axis`) or None.
    Options as in `wkv7_sequence_parallel` (`output_dtype` None: v's dtype; `platform`: the
    mesh's, `lwm_jax.hardware.platform_of`, None: JAX's default devices'). With the Pallas
    kernel the enclosing `shard_map` needs `check_vma=False` (the kernels' outputs carry no
    varying-axis types).

    Returns `(o [B_loc, T/n, H_loc, V] in output_dtype, final_state [B_loc, H_loc, K, V]
    float32)`: this slice's outputs of the global sequence, and the state after the global last
    position (equal on every device of `axis`, but typed as varying over it).
    Communication: one all_gather of the `[B_loc, H_loc, K, K + V]` float32 slice maps, and with
    segment ids one ppermute of `B_loc` int32 ids.
    """
    n = _axis_size(axis)
    K, V = r.shape[-1], v.shape[-1]
    Bl, _, Hl, _ = r.shape
    out_dtype = jnp.dtype(v.dtype if output_dtype is None else output_dtype)
    chosen = _resolve_impl(impl, platform)
    pair_op = _pallas_pair(V, platform) if fuse is None and chosen == "pallas" else None
    if fuse is None:
        fuse = chosen != "pallas"
    mm_precision = jax.lax.Precision(xla_precision(precision))
    op_kwargs = dict(impl=impl, chunk_size=chunk_size, precision=precision,
                     output_dtype=jnp.float32, return_state=True, platform=platform)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
    if n == 1:   # one slice: the plain op (the identity pass would only add zero)
        X0 = (jnp.zeros((Bl, Hl, K, V), jnp.float32) if initial_state is None
              else jnp.asarray(initial_state).astype(jnp.float32))
        return wkv7(r, w, k, v, a, b, initial_state=_vary_like(X0, r, w, k, v, a, b),
                    segment_ids=segment_ids, impl=impl, chunk_size=chunk_size,
                    precision=precision, output_dtype=out_dtype, return_state=True,
                    platform=platform)

    # Step 2's start state: the identity, or zeros in rows whose slice starts a new document
    # (such a slice ignores the state before it: Phi = 0 from its first token on).
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (Bl, Hl, K, K))
    if segment_ids is not None and n > 1:
        keep_B = ~slice_starts_document(segment_ids, axis)
        eye = eye * keep_B[:, None, None, None].astype(jnp.float32)
    # Explicit start states, typed as varying like the inputs (the op's scan carries them).
    eye = _vary_like(eye, r, w, k, v, a, b)
    zero_state = _vary_like(jnp.zeros((Bl, Hl, K, V), jnp.float32), r, w, k, v, a, b)
    zeros_v = jnp.zeros((*r.shape[:3], K), v.dtype)
    if pair_op is not None:   # Pallas GPU kernels: one intra-chunk pass serves both passes
        o_loc, D, q, M = pair_op(r, w, k, v, a, b, zero_state, eye, segment_ids, chunk_size,
                                 jnp.float32, precision=precision)      # (pallas_gpu/pair.py)
    elif fuse:   # one call: value columns [v | 0], start state [0 | I]
        o_cat, s_cat = wkv7(r, w, k, jnp.concatenate([v, zeros_v], axis=-1), a, b,
                            initial_state=jnp.concatenate([zero_state, eye], axis=-1),
                            segment_ids=segment_ids, **op_kwargs)
        o_loc, q = o_cat[..., :V], o_cat[..., V:]      # [Bl, T/n, Hl, V], [Bl, T/n, Hl, K]
        D, M = s_cat[..., :V], s_cat[..., V:]          # [Bl, Hl, K, V],   [Bl, Hl, K, K]
    else:
        o_loc, D = wkv7(r, w, k, v, a, b, initial_state=zero_state, segment_ids=segment_ids,
                        **op_kwargs)
        q, M = wkv7(r, w, k, zeros_v, a, b, initial_state=eye, segment_ids=segment_ids,
                    **op_kwargs)

    # Step 3: every device composes the prefix of all slices (n tiny products).
    M_all = jax.lax.all_gather(M, axis)   # [n, Bl, Hl, K, K]
    D_all = jax.lax.all_gather(D, axis)   # [n, Bl, Hl, K, V]
    X0 = (jnp.zeros((Bl, Hl, K, V), jnp.float32) if initial_state is None
          else jnp.asarray(initial_state).astype(jnp.float32))
    X0 = _vary_like(X0, M_all, D_all)

    def compose(X, MD):
        M_d, D_d = MD
        X_next = jnp.einsum("bhkj,bhjv->bhkv", M_d, X, precision=mm_precision,
                            preferred_element_type=jnp.float32) + D_d
        return X_next, X

    X_n, X_starts = jax.lax.scan(compose, X0, (M_all, D_all))   # X_starts[d] = X_d
    # Step 4: o_t = o_loc_t + X_d^T q_t.
    X_d = X_starts[jax.lax.axis_index(axis)]
    o = o_loc + jnp.einsum("bthk,bhkv->bthv", q, X_d, precision=mm_precision,
                           preferred_element_type=jnp.float32)
    return o.astype(out_dtype), X_n


def wkv7_sequence_parallel(r, w, k, v, a, b, *, mesh, axis="sequence", initial_state=None,
                           segment_ids=None, impl="auto", chunk_size=None, output_dtype=None,
                           return_state=False, precision=None, batch_axes=None, head_axis=None,
                           fuse=None, platform=None):
    """`lwm_jax.ops.wkv7.wkv7` with the time axis sharded over the mesh axis `axis`.

    Same contract and results as `wkv7` (FLA layout, float32 state, segment ids reset the state
    where the id changes, position 0 continues from `initial_state`); see the module docstring
    for the algorithm. Works inside or outside `jax.jit`; the inputs may have any sharding (they
    are resharded to the specs below on entry). Inside an existing `shard_map`, use
    `wkv7_sequence_parallel_local` instead.

    Args:
      r, w, k, a, b: `[B, T, H, K]`; v: `[B, T, H, V]` (dtypes as `wkv7`: r, k, v, a, b share
        bf16 / f16 / f32, w may be f32). Sharded as `P(batch_axes, axis, head_axis, None)`.
      mesh: the `jax.sharding.Mesh` (e.g. `lwm_jax.train.sharding.make_mesh`).
      axis: mesh axis that splits T into n contiguous slices; T must be divisible by n (n = 1
        runs the plain per-device op, with no identity pass and no communication).
      initial_state: `[B, H, K, V]` float32 or None (zeros); sharded over batch (and heads).
      segment_ids: int `[B, T]` or None, sharded like the tokens; documents may start on or
        span slice boundaries.
      impl, chunk_size, precision: passed to the per-device `wkv7` ("auto": the Pallas kernel on
        GPU/TPU, chunked on CPU). `precision` also sets the matmul precision of the prefix
        composition and output correction (None: "highest").
      output_dtype: dtype of `o` (default v.dtype); the per-device results stay float32 until
        the corrected output is cast once, as in `wkv7`.
      return_state: also return the float32 final state `[B, H, K, V]`.
      batch_axes: mesh axes splitting B (default: those of ("data", "fsdp") in the mesh, as in
        `lwm_jax.layers.layout.activation_spec`); B must be divisible by their product.
      head_axis: optional mesh axis splitting H (e.g. "tensor"); the op is independent per head.
      fuse: run the local and identity passes as one call with `[v | 0]` (value width V + K).
        None: fuse unless the chosen implementation is "pallas"; with the Pallas GPU kernels
        (V <= 64) the two passes then share one intra-chunk launch and its saved factors
        (`pallas_gpu/pair.py`); on TPU they are two calls. False: two calls everywhere.
      platform: the platform the program is compiled for; None = the mesh's devices'
        (`lwm_jax.hardware.platform_of`), which picks "auto"'s kernel family.

    Returns:
      `o [B, T, H, V]` in output_dtype, or `(o, final_state [B, H, K, V] float32)`.

    Cost per device (slice length T/n): the identity pass adds the work of a WKV7 call with
    value width K (fused: one call of width V + K instead of V, sharing the chunk terms; its
    measured cost is in benchmarks/RESULTS.md), the
    output correction `B_loc T/n H_loc K V` multiply-adds, the prefix n `[K, K] x [K, V]`
    products per batch row and head; communication as in the module docstring.
    """
    check_wkv7_inputs(r, w, k, v, a, b, initial_state, segment_ids)
    n, batch_axes, out_dtype = _check_options(mesh, axis, batch_axes, head_axis, r.shape,
                                              impl, chunk_size, output_dtype, precision, v.dtype)
    bspec = batch_axes if batch_axes else None
    x_spec = P(bspec, axis, head_axis, None)
    s_spec = P(bspec, head_axis, None, None)
    has_s0, has_seg = initial_state is not None, segment_ids is not None
    platform = platform or platform_of(mesh)

    def body(r, w, k, v, a, b, *rest):
        o, X_n = wkv7_sequence_parallel_local(
            r, w, k, v, a, b, axis=axis, initial_state=rest[0] if has_s0 else None,
            segment_ids=rest[-1] if has_seg else None, impl=impl, chunk_size=chunk_size,
            output_dtype=out_dtype, precision=precision, fuse=fuse, platform=platform)
        return o, X_n[None]

    args, in_specs = [r, w, k, v, a, b], [x_spec] * 6
    if has_s0:
        args.append(jnp.asarray(initial_state).astype(jnp.float32))
        in_specs.append(s_spec)
    if has_seg:
        args.append(jnp.asarray(segment_ids).astype(jnp.int32))
        in_specs.append(P(bspec, axis))
    out_specs = (x_spec, P(axis, *s_spec))
    # The Pallas kernels declare their outputs without varying-axis types, which shard_map's
    # type check (check_vma) rejects; without the check, shard_map's transpose sums the
    # cotangents of inputs replicated over a mesh axis (initial_state over `axis`) itself.
    check_vma = _resolve_impl(impl, platform) != "pallas"
    fn = _shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                    check_vma=check_vma)
    o, X_n_per_device = fn(*args)   # [n, B, H, K, V]: every device's copy of the final state
    return (o, X_n_per_device[-1]) if return_state else o
