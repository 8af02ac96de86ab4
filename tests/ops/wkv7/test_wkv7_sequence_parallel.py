"""Sequence-parallel WKV7 (T sharded over the "sequence" mesh axis) against the unsharded op.

The checks run in one subprocess with 8 simulated CPU devices (the device count must be set
before jax initialises, as in tests/train/test_sharding.py); it prints one JSON line of measured
relative errors per case, and the tests below assert on them.

Tolerances: float32 outputs, final state and every gradient within 1e-5 relative (Frobenius) of
the unsharded op, "chunked" and "recurrent" alike (measured: at most 4e-7; ignoring a document
start at a slice boundary costs > 1e-1). bf16 inputs: within 2e-2 of the unsharded op on the same
bf16 inputs (measured: at most 6e-5, both round one float32 result to bf16 once).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from lwm_jax.ops.wkv7.testing import random_wkv7_inputs
from lwm_jax.ops.wkv7.sequence_parallel import wkv7_sequence_parallel
from lwm_jax.train.sharding import MESH_AXES

TOL_F32 = 1e-5
TOL_BF16 = 2e-2

# name: mesh sizes (data, fsdp, tensor, sequence), T, per-device impl, initial state,
# segments ("edges": documents ending on / spanning slice boundaries, None: no segment ids),
# dtype, fuse (None = default), head_axis.
CASES = {
    "seq8": ((1, 1, 1, 8), 128, "chunked", True, "edges", "float32", None, None),
    "seq4_data2": ((2, 1, 1, 4), 64, "recurrent", False, "edges", "float32", None, None),
    "seq2_fsdp2": ((1, 2, 1, 2), 64, "chunked", True, None, "float32", False, None),
    "seq1_data2": ((2, 1, 1, 1), 64, "recurrent", True, "edges", "float32", None, None),
    "seq4_heads2_bf16": ((1, 1, 2, 4), 128, "chunked", True, "edges", "bfloat16", None, "tensor"),
    # the Pallas kernel (interpreted on CPU) per device, its two passes sharing one intra-chunk
    # launch (pallas_gpu/pair.py), run without shard_map's varying-axis type check; "tensor"
    # (size 2) is an unused mesh axis here
    "seq4_pallas": ((1, 1, 2, 4), 64, "pallas", True, "edges", "float32", None, None),
}

DRIVER = textwrap.dedent("""
    import json, sys, time, zlib
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from lwm_jax.layers import token_shift
    from lwm_jax.ops.wkv7 import wkv7
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err
    from lwm_jax.ops.wkv7.sequence_parallel import shift_across_slices, wkv7_sequence_parallel
    from lwm_jax.train.sharding import make_mesh, MESH_AXES

    assert jax.device_count() == 8, jax.devices()
    B, H, K, V = 2, 2, 16, 16
    NAMES = ("r", "w", "k", "v", "a", "b", "initial_state")

    def mesh_of(sizes):
        n = int(np.prod(sizes))
        return make_mesh(dict(zip(MESH_AXES, sizes)), jax.devices()[:n])

    def edge_segments(T, L):
        # Row 0: documents end exactly on slice boundaries (L, 3L), one starts mid-slice and
        # spans the next boundaries, a one-token document is the last token of the sequence.
        # Row 1: ids alternate 0/1 (only "differs from the previous id" matters); resets at 1,
        # at L + 1 (one after a boundary), 2L - 1 and 2L (a one-token document that is a
        # slice's last token, then a reset on the boundary).
        seg = np.zeros((B, T), np.int32)
        for c in sorted({L, L + L // 2 + 3, 3 * L, T - 1} & set(range(1, T))):
            seg[0, c:] += 1
        for c in sorted({1, L + 1, 2 * L - 1, 2 * L} & set(range(1, T))):
            seg[1, c:] = 1 - seg[1, c]
        return seg

    def run_case(name, sizes, T, impl, use_s0, seg_kind, dtype, fuse, head_axis):
        mesh = mesh_of(sizes)
        n = sizes[3]
        seed = zlib.crc32(name.encode()) % 1000
        xs = random_wkv7_inputs(seed, B, T, H, K, V, jnp.dtype(dtype))
        s0 = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, H, K, V)) if use_s0 else None
        seg = jnp.asarray(edge_segments(T, T // n)) if seg_kind == "edges" else None
        rng = np.random.default_rng(seed)
        d_o = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
        d_s = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)

        def loss_fn(op):
            def loss(xs, s0):
                o, s = op(*xs, initial_state=s0, segment_ids=seg, return_state=True)
                return jnp.sum(o.astype(jnp.float32) * d_o) + jnp.sum(s * d_s), (o, s)
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

        sp = lambda *a, **kw: wkv7_sequence_parallel(*a, mesh=mesh, impl=impl, chunk_size=16,
                                                     fuse=fuse, head_axis=head_axis, **kw)
        (_, (o, s)), (g_xs, g_s0) = loss_fn(sp)(xs, s0)
        assert o.shape == (B, T, H, V) and o.dtype == jnp.dtype(dtype), (o.shape, o.dtype)
        assert s.shape == (B, H, K, V) and s.dtype == jnp.float32, (s.shape, s.dtype)
        errs = {}
        for ref_impl in ("chunked", "recurrent"):
            ref = lambda *a, **kw: wkv7(*a, impl=ref_impl, chunk_size=16, **kw)
            (_, (ro, rs)), (rg_xs, rg_s0) = loss_fn(ref)(xs, s0)
            pairs = [("o", o, ro), ("state", s, rs)]
            pairs += [("d" + k, g, rg) for k, g, rg in zip(NAMES, (*g_xs, g_s0),
                                                            (*rg_xs, rg_s0)) if g is not None]
            errs[ref_impl] = {k: rel_err(np.asarray(x, np.float32), np.asarray(y, np.float32))
                              for k, x, y in pairs}
        # intra-chunk forward launches in the traced step (the Pallas pair shares one)
        launches = str(jax.make_jaxpr(loss_fn(sp))(xs, s0)).count("name=wkv7_intra_fwd")
        return {"errs": errs, "sharding": str(o.sharding.spec), "intra_fwd": launches}

    def shift_check(sizes, T, C=8):
        mesh = mesh_of(sizes)
        n = sizes[3]
        x = jax.random.normal(jax.random.PRNGKey(T + n), (B, T, C))
        first = jax.random.normal(jax.random.PRNGKey(T + n + 1), (B, C))
        seg = jnp.asarray(edge_segments(T, T // n))
        spec, bspec = P(("data", "fsdp"), "sequence"), P(("data", "fsdp"))
        out = {}
        plain = jax.shard_map(lambda x: shift_across_slices(x, "sequence"), mesh=mesh,
                              in_specs=spec, out_specs=spec)(x)
        want = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
        out["plain"] = bool(np.array_equal(plain, want))
        full = jax.shard_map(
            lambda x, f, s: shift_across_slices(x, "sequence", first_BC=f, segment_ids_BT=s),
            mesh=mesh, in_specs=(spec, bspec, spec), out_specs=spec)(x, first, seg)
        out["first_and_segments"] = bool(np.array_equal(full, token_shift(x, first, seg)))
        # the segment mask must bite at a slice boundary (row 0 resets at position T / n)
        out["boundary_zeroed"] = bool(n == 1 or np.all(np.asarray(full)[0, T // n] == 0))
        return out

    cases = json.loads(sys.argv[1])
    results = {}
    for name, spec in cases.items():
        t0 = time.perf_counter()
        results[name] = run_case(name, *spec)
        results[name]["seconds"] = time.perf_counter() - t0
    results["shift"] = {"seq8": shift_check((1, 1, 1, 8), 64),
                        "seq4_data2": shift_check((2, 1, 1, 4), 32),
                        "seq1": shift_check((2, 1, 1, 1), 16)}
    print("RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def results(subprocess_env):
    env = subprocess_env(8, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(CASES)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


@pytest.mark.slow       # the module's cases are computed together first (~70 s)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_unsharded_op(results, name):
    """Outputs, final state and every gradient equal the unsharded op (both implementations)."""
    tol = TOL_BF16 if CASES[name][5] == "bfloat16" else TOL_F32
    res = results[name]
    expected = {"o", "state", "dr", "dw", "dk", "dv", "da", "db"}
    if CASES[name][3]:
        expected.add("dinitial_state")
    for ref_impl, errs in res["errs"].items():
        assert set(errs) == expected, (ref_impl, sorted(errs))
        bad = {k: e for k, e in errs.items() if not e <= tol}
        assert not bad, (name, ref_impl, bad)
    if CASES[name][0][3] > 1:    # jax drops size-1 mesh axes from the printed spec
        assert "sequence" in res["sharding"], res["sharding"]
    if CASES[name][2] == "pallas":
        # both passes of each slice from one intra-chunk launch (pallas_gpu/pair.py)
        assert res["intra_fwd"] == 1, res["intra_fwd"]


def test_shift_across_slices(results):
    for mesh, checks in results["shift"].items():
        assert checks == {"plain": True, "first_and_segments": True, "boundary_zeroed": True}, \
            (mesh, checks)


def test_errors_are_one_line():
    xs = random_wkv7_inputs(0, 2, 60, 2, 16, 16)
    mesh = AbstractMesh((1, 1, 1, 8), MESH_AXES)
    with pytest.raises(ValueError, match=r"^wkv7_sequence_parallel: T=60 must be divisible by "
                                         r"the size 8 of mesh axis 'sequence'$"):
        wkv7_sequence_parallel(*xs, mesh=mesh)
    xs = random_wkv7_inputs(0, 3, 64, 2, 16, 16)
    with pytest.raises(ValueError, match=r"batch B=3 must be divisible by the 2 devices"):
        wkv7_sequence_parallel(*xs, mesh=AbstractMesh((2, 1, 1, 4), MESH_AXES))
    with pytest.raises(ValueError, match=r"axis 'seq' is not a mesh axis"):
        wkv7_sequence_parallel(*xs, mesh=mesh, axis="seq")
    with pytest.raises(ValueError, match=r"impl must be one of"):
        wkv7_sequence_parallel(*xs, mesh=AbstractMesh((1, 1, 1, 4), MESH_AXES), impl="triton")
    with pytest.raises(TypeError, match=r"k has dtype bfloat16 but r"):
        wkv7_sequence_parallel(xs[0], xs[1], xs[2].astype(jnp.bfloat16), *xs[3:], mesh=mesh)
