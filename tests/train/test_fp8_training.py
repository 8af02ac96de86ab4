"""Training under `fp8-mixed`: the block GEMMs really are FP8, their scaling state is part of
the train state (updated every step, kept on a skipped step, checkpointed, resumed exactly,
combined over micro-batches) and evaluation quantizes with the run's current scales."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.precision import fp8
from lwm_jax.train.config import load_config
from lwm_jax.train.trainer import build_program, train

SMALL = ["model.n_layer=2", "model.n_embd=64", "train.ctx_len=32", "train.batch_size=4",
         "train.log_every=1", "train.eval_every=0", "train.warmup_steps=1", "train.lr=1e-3",
         "train.min_lr=1e-4"]
DATA_DOCS = (20, 1000)
SITES = {"att": ("fp8_receptance", "fp8_key", "fp8_value", "fp8_output"),
         "ffn": ("fp8_key", "fp8_value")}
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)

pytestmark = pytest.mark.usefixtures("compile_cache")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("precision, want", [("fp8-mixed", 2 * 6 * 3), ("bf16-mixed", 0)])
def test_every_block_gemm_is_fp8(precision, want):
    """Without the layer scan each of the 2 layers' 6 block GEMMs (time-mix r/k/v/output,
    channel-mix key/value) is 3 float8 products in the step (forward, two gradients); a GEMM
    meant to be FP8 that is not would lower the count. bf16-mixed has none."""
    prog = build_program(load_config(None, [*SMALL, f"precision={precision}",
                                            "runtime.scan_layers=false"]))
    tokens = jnp.zeros((4, 33), jnp.int32)
    jaxpr = jax.make_jaxpr(prog.train_step)(prog.abstract_state, tokens)
    assert fp8.float8_dots(jaxpr.jaxpr) == want


@pytest.mark.parametrize("config, want", [
    ("configs/llama-tiny.yaml", 2 * 7 * 3),                  # q/k/v/o, gate/up/down
    ("configs/rwkv7-hybrid-tiny.yaml", (1 * 6 + 1 * 6) * 3),  # RWKV layer 0; attention layer 1:
])                                                          # q/k/v/o + channel-mix key/value
def test_llama_and_hybrid_gemms_are_fp8_and_their_scales_follow(config, want):
    """Under fp8-mixed every block GEMM of LLaMA and of the hybrid's RWKV and attention layers
    is 3 float8 products per step; one step records an input amax at every site and layer
    (scale 1), the next quantizes inputs with the power of two at or above amax / 448."""
    over = ["precision=fp8-mixed", "model.n_layer=2", "model.n_embd=64", "train.ctx_len=32",
            "train.batch_size=2", "runtime.scan_layers=false"]
    if "hybrid" in config:
        over += ["model.attention_layers=[1]", "model.attn_kv_heads=1"]
    else:
        over += ["model.n_head=2", "model.n_kv_head=1", "model.head_dim=32",
                 "model.ffn_hidden=128"]
    prog = build_program(load_config(config, over))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, 256)
    jaxpr = jax.make_jaxpr(prog.train_step)(prog.abstract_state, tokens)
    assert fp8.float8_dots(jaxpr.jaxpr) == want
    state = prog.init_state()
    state, m1 = prog.train_step(state, tokens)
    one = jax.device_get(state.fp8)
    state, m2 = prog.train_step(state, tokens)
    two = jax.device_get(state.fp8)
    assert float(m1["finite"]) == float(m2["finite"]) == 1
    flat1, flat2 = jax.tree.leaves(one), jax.tree.leaves(two)
    assert len(flat1) == want // 3 // (2 if "llama" in config else 1)
    for a, b in zip(flat1, flat2):
        np.testing.assert_array_equal(a[:, :, 0], 1.0)
        assert np.all(a[:, 0, 1] > 0)
        amax = a[:, 0, 1]
        np.testing.assert_array_equal(b[:, 0, 0], 2.0 ** np.ceil(np.log2(amax / E4M3_MAX)))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_scaling_state_follows_the_steps(grad_accum):
    """Step 1 records every site's maxima at scale 1; step 2 quantizes with scale = the power
    of two at or above recorded amax / 448 (e4m3) for inputs and kernels; with two micro-batches the same holds for the
    combined (maximum) state."""
    prog = build_program(load_config(None, [*SMALL, "precision=fp8-mixed",
                                            f"train.grad_accum={grad_accum}"]))
    state = prog.init_state()
    for mixer, names in SITES.items():
        for name in names:
            meta = state.fp8["blocks"][mixer][name]
            assert meta.shape == (2, 3, 1 + 1024) and meta.dtype == jnp.float32
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 256)
    if grad_accum > 1:
        tokens = tokens.reshape(grad_accum, 4 // grad_accum, 33)
    state, m1 = prog.train_step(state, tokens)
    one = jax.device_get(state.fp8)
    state, m2 = prog.train_step(state, tokens)
    two = jax.device_get(state.fp8)
    assert float(m1["finite"]) == float(m2["finite"]) == 1
    for mixer, names in SITES.items():
        for name in names:
            a, b = one["blocks"][mixer][name], two["blocks"][mixer][name]
            np.testing.assert_array_equal(a[:, :, 0], 1.0)
            assert np.all(a[:, 0, 1] > 0), (mixer, name)        # every input seen
            # kernels initialised to zero (time-mix output, channel-mix value) record 0 and
            # keep scale 1 until they have grown
            amax = a[:, :2, 1]
            want = np.where(amax > 0, 2.0 ** np.ceil(np.log2(amax / E4M3_MAX)), 1.0)
            np.testing.assert_array_equal(b[:, :2, 0], want)


def test_fp8_resume_is_exact(tmp_path, data_prefix):
    """4 steps in one run equal 2 + 2 across a checkpoint: params, moments and the FP8 metas,
    and the evaluation loss (which reads the metas)."""
    common = [*SMALL, "precision=fp8-mixed", "train.steps=4", f"data.path={data_prefix}",
              "checkpoint.every=2", "train.eval_every=4", "train.eval_batches=1"]
    full = train(load_config(None, [*common, f"run_dir={tmp_path / 'full'}"]), progress=False)
    split_cfg = load_config(None, [*common, f"run_dir={tmp_path / 'split'}"])
    train(split_cfg, progress=False, stop_after=2)
    second = train(split_cfg, progress=False)
    assert full.step == second.step == 4
    assert full.state.fp8 is not None
    for a, b in zip(jax.tree.leaves((full.state.params, full.state.opt_state, full.state.fp8)),
                    jax.tree.leaves((second.state.params, second.state.opt_state,
                                     second.state.fp8))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
    assert abs(second.final_val_loss - full.final_val_loss) <= 1e-6 * full.final_val_loss


MESH_DRIVER = textwrap.dedent(r"""
    import json, sys
    import jax, numpy as np
    from lwm_jax.train.config import load_config
    from lwm_jax.train.trainer import build_program
    prog = build_program(load_config(None, json.loads(sys.argv[1])))
    state = prog.init_state()
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 256)
    first = None
    for _ in range(3):
        state, metrics = prog.train_step(state, tokens)
        first = first or [np.asarray(m).tolist() for m in jax.tree.leaves(state.fp8)]
    metas = jax.tree.leaves(state.fp8)
    print(json.dumps({"devices": int(prog.mesh.size), "loss": float(metrics["loss"]),
                      "specs": sorted({str(m.sharding.spec) for m in metas}), "first": first,
                      "metas": [np.asarray(m).tolist() for m in metas]}))
""")


def test_fp8_state_on_a_mesh_matches_one_device(subprocess_env):
    """3 fp8-mixed steps on data 2 x fsdp 2 (4 CPU devices: batch split, parameters sharded)
    match one CPU device: the loss, every scale, and every amax the first step records (an
    amax taken per shard instead of over the whole tensor would differ); the scaling state is
    replicated. Both runs on the CPU, each in its own process: on a GPU machine an in-process
    reference would run on the GPU, whose products round differently from the CPU's.

    Only the first step's amaxes are compared value by value: both runs start from the same
    parameters there, so each amax differs by at most the rounding of a sharded sum. After an
    update the runs' parameters differ by rounding, and Adam's normalisation turns rounding-
    level gradients of near-zero parameters into different updates, so a later amax of a tiny
    tensor is not bounded by one rounding (seen: a gradient amax of 4.4e-7 three bf16 ulps
    apart at step 3 on an AVX-512 host, while the loss agreed to 2e-5)."""
    over = [*SMALL, "precision=fp8-mixed"]

    def run(devices, extra):
        env = subprocess_env(devices, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", MESH_DRIVER, json.dumps([*over, *extra])],
                              env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    mesh, single = run(4, ["mesh.data=2", "mesh.fsdp=2"]), run(1, [])
    assert mesh["devices"] == 4 and mesh["specs"] == ["P()"] and single["devices"] == 1
    assert mesh["loss"] == pytest.approx(single["loss"], rel=2e-5)
    one = [np.asarray(m, np.float32) for m in single["first"]]
    assert len(one) == len(mesh["first"]) == len(single["metas"]) == len(mesh["metas"])
    # the first step's amaxes are bf16 values: a sharded sum upstream may move one by an ulp
    # (2^-8 relative, at most 2^-7 across a binade edge); a per-shard maximum would be far off
    for a, b in zip(one, mesh["first"]):
        assert np.any(a[..., 1] > 0)        # the step recorded its amaxes
        np.testing.assert_allclose(np.asarray(b), a, rtol=2.0**-7, atol=0)
    # every scale after 3 steps: powers of two, equal
    for a, b in zip(single["metas"], mesh["metas"]):
        np.testing.assert_array_equal(np.asarray(b)[..., 0], np.asarray(a)[..., 0])
