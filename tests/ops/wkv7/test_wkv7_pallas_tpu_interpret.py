"""The TPU WKV7 kernel (`pallas_tpu.op.wkv7_tpu`) inside `shard_map` over a batch-sharded mesh.

`test_wkv7_tpu.py` already checks the kernel's forward and backward on one device in interpret
mode against float64, and its Mosaic lowering. What it leaves out is the multi-chip setting:
the kernel as each chip's body of a `shard_map` whose batch is split over (data, fsdp), the way
a data/fsdp-sharded TPU run has to call an opaque kernel. Here, in one subprocess with 4
simulated CPU devices (the device count is fixed before jax starts, as in
tests/train/test_sharding.py):

- interpret mode, mesh data=2 x fsdp=2, packed-document segment ids: outputs, final state and
  all seven gradients (through shard_map's transpose) against the float64 recurrence on the
  whole batch (fp32: 1e-5 outputs, 1e-4 gradients, as in test_wkv7_tpu.py; measured ~3e-7);
- the same program's gradient exported for the TPU platform: exactly two Mosaic kernels
  (forward, backward), each called on the per-chip batch (B / 4 rows x H heads), not the
  global one.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent("""
    import json, re
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from lwm_jax.ops.wkv7.pallas_tpu.op import wkv7_tpu
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
    from lwm_jax.train.sharding import make_mesh

    assert jax.device_count() == 4, jax.devices()
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "sequence": 1})
    B, T, H, K, C = 4, 32, 2, 16, 16
    rows = P(("data", "fsdp"))
    xs = random_wkv7_inputs(11, B, T, H, K, K, jnp.float32)
    h0 = jax.random.normal(jax.random.PRNGKey(1), (B, H, K, K), jnp.float32)
    seg = np.zeros((B, T), np.int32)
    seg[0, 5:] = 1; seg[1, 16:] = 1; seg[2, 31:] = 1        # mid-chunk, boundary, last token
    seg = jnp.asarray(seg)

    def sharded(xs, h0, seg, interpret):
        body = lambda xs, h0, seg: wkv7_tpu(*xs, h0, seg, C, None, interpret=interpret)
        return jax.shard_map(body, mesh=mesh, in_specs=((rows,) * 6, rows, rows),
                             out_specs=(rows, rows), check_vma=False)(xs, h0, seg)

    (o, s_T), vjp = jax.vjp(jax.jit(lambda xs, h0: sharded(xs, h0, seg, True)), xs, h0)
    rng = np.random.default_rng(0)
    d_o = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    d_s = jnp.asarray(rng.standard_normal(s_T.shape), jnp.float32)
    d_xs, d_h0 = vjp((d_o, d_s))
    ref_o, ref_s, ref_g = wkv7_reference_vjp_f64(xs, h0, seg, d_o, d_s)
    errs = {"o": rel_err(o, ref_o), "state": rel_err(s_T, ref_s),
            "initial_state": rel_err(d_h0, ref_g["initial_state"])}
    errs.update({n: rel_err(g, ref_g[n]) for n, g in zip("rwkvab", d_xs)})

    def loss(xs, h0, seg):
        o, s_T = sharded(xs, h0, seg, False)
        return jnp.sum(o ** 2) + jnp.sum(s_T ** 2)

    spec = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(
        shape, dt, sharding=NamedSharding(mesh, rows))
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=("tpu",))(
        tuple(spec((B, T, H, K)) for _ in range(6)), spec((B, H, K, K)), spec((B, T), jnp.int32))
    text = exported.mlir_module()
    kernels = [ln for ln in text.splitlines() if "tpu_custom_call" in ln and "call(" in ln]
    # the kernels take r, w, k, ... as [B * H, T, K]: the leading size says how many rows
    rows_seen = sorted({int(n) for ln in kernels
                        for n in re.findall(rf"tensor<(\\d+)x{T}x{K}xf32>", ln)})
    print("RESULTS " + json.dumps({"errs": errs, "sharding": str(o.sharding.spec),
                                   "kernels": len(kernels), "rows_seen": rows_seen,
                                   "platforms": list(exported.platforms)}))
""")


@pytest.fixture(scope="module")
def results(subprocess_env):
    env = subprocess_env(4, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


def test_batch_sharded_kernel_matches_float64(results):
    errs = results["errs"]
    assert set(errs) == {"o", "state", "initial_state", "r", "w", "k", "v", "a", "b"}
    assert errs["o"] <= 1e-5 and errs["state"] <= 1e-5, errs
    assert all(e <= 1e-4 for e in errs.values()), errs
    assert "data" in results["sharding"] and "fsdp" in results["sharding"]


def test_each_chip_runs_the_kernel_on_its_own_rows(results):
    assert results["platforms"] == ["tpu"] and results["kernels"] == 2, results
    # B = 4 rows over 4 chips: each kernel sees 1 row x H = 2 heads (the whole batch: 8)
    assert results["rows_seen"] == [2], results
