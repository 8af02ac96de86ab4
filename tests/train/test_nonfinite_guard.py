"""The non-finite guard: a NaN/inf loss or gradient never reaches the parameters or a
checkpoint, skipped steps are counted, and a run whose steps keep failing stops with one line
naming the first op that produced a non-finite value."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax import ModelConfig
from lwm_jax.cli import main as cli_main
from lwm_jax.diagnostics.nonfinite import describe, first_nonfinite, nonfinite_params, tap_stats
from lwm_jax.models.rwkv7 import RWKV7, probe_model_fn
from lwm_jax.precision import parse_policy
from lwm_jax.train.checkpoint import Checkpointer
from lwm_jax.train.config import CheckpointSection, load_config
from lwm_jax.train.guard import SkipWatch
from lwm_jax.train.metrics import read_metrics
from lwm_jax.train.trainer import build_program, train

SMALL = ["model.n_layer=2", "model.n_embd=64", "train.ctx_len=32", "train.batch_size=4",
         "train.log_every=1", "train.eval_every=0", "train.warmup_steps=1"]
# Adam moves every weight by ~lr per step: lr = 1000 blows the activations up within a few steps
DIVERGE = [*SMALL, "train.lr=1000", "train.min_lr=1000", "train.steps=40"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp8-mixed"])
def test_a_nonfinite_step_changes_nothing_but_the_counters(precision):
    """A skipped step keeps the params, the moments and, under fp8-mixed, the FP8 GEMMs'
    scaling state (a non-finite amax never enters it)."""
    prog = build_program(load_config(None, [*SMALL, f"precision={precision}"]))
    state = prog.init_state()
    good = jax.random.randint(jax.random.PRNGKey(0), (4, 33), 0, 256)
    state, m = prog.train_step(state, good)
    assert float(m["finite"]) == 1 and float(m["skipped_steps"]) == 0
    before = jax.device_get(state)
    # an out-of-range id gives a NaN embedding (jnp.take's fill), hence a NaN loss
    bad = good.at[1, 5].set(10_000)
    state, m = prog.train_step(state, bad)
    assert not np.isfinite(float(m["loss"]))
    assert float(m["finite"]) == 0 and float(m["skipped_steps"]) == 1
    assert int(state.step) == 2
    after = jax.device_get(state)
    assert (before.fp8 is None) == (precision != "fp8-mixed")
    for x, y in zip(jax.tree.leaves((before.params, before.opt_state, before.fp8)),
                    jax.tree.leaves((after.params, after.opt_state, after.fp8))):
        np.testing.assert_array_equal(x, y)
    state, m = prog.train_step(state, good)          # training goes on from the same params
    assert float(m["finite"]) == 1 and float(m["skipped_steps"]) == 1


def test_skip_watch_counts_runs_one_step_late():
    ok, bad = {"finite": 1.0}, {"finite": 0.0}
    watch = SkipWatch(limit=2)
    assert not watch.push(1, bad, "t1")      # step 1 is not read until step 2 is pushed
    assert not watch.push(2, ok, "t2")       # reads step 1: one skip
    assert not watch.push(3, bad, "t3")      # reads step 2: the run resets
    assert not watch.push(4, bad, "t4")      # reads step 3: one in a row
    assert watch.push(5, ok, "t5")           # reads step 4: two in a row -> stop
    assert watch.last_bad == (4, "t4") and watch.total == 3
    fp16 = SkipWatch(limit=1, min_loss_scale=1.0)
    fp16.push(1, {"finite": 0.0, "loss_scale": 2.0 ** 14}, None)
    assert not fp16.flush()                  # a routine overflow while the scale can still fall
    fp16.push(2, {"finite": 0.0, "loss_scale": 1.0}, None)
    assert fp16.flush()                      # overflow at the minimum scale counts
    assert not SkipWatch(limit=0).push(1, bad, None) and not SkipWatch(0).flush()


@pytest.mark.slow
def test_diverging_run_stops_names_the_op_and_checkpoints_only_finite_params(tmp_path, capsys):
    cfg = load_config(None, [*DIVERGE, "train.max_consecutive_skips=3",
                             f"run_dir={tmp_path / 'run'}"])
    result = train(cfg, progress=False)
    assert result.stopped_by == "non-finite" and result.step < 40
    assert "3 steps in a row had a non-finite loss or gradient" in result.diagnosis
    assert "first non-finite value at " in result.diagnosis
    assert "\n" not in result.diagnosis
    assert nonfinite_params(result.state.params) == []
    records, _ = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert records[-1]["skipped_steps"] >= 3
    assert all("skipped_steps" in r for r in records)
    ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint)
    assert ckpt.latest_step() == result.step
    ckpt.close()
    # The CLI says it in one line on stderr and exits 3.
    code = cli_main(["train", "--no-progress", *DIVERGE, "train.max_consecutive_skips=3",
                     f"run_dir={tmp_path / 'cli'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1 and err[0].startswith("lwm-jax train: error: stopped: ")


def test_diverging_fp8_run_names_the_op_and_the_largest_fp8_amax(tmp_path):
    """Under fp8-mixed an inf inside a GEMM input (the loss stays finite: quantization clips
    it) fails the step like a non-finite loss; the localiser runs with the run's FP8 scaling
    state; the line also names the FP8 tensor whose amax grew most; the checkpointed scaling
    state is finite."""
    cfg = load_config(None, [*DIVERGE, "precision=fp8-mixed", "train.max_consecutive_skips=3",
                             f"run_dir={tmp_path / 'run'}"])
    result = train(cfg, progress=False)
    assert result.stopped_by == "non-finite"
    assert "the forward re-run that localises it failed" not in result.diagnosis
    assert re.search(r"largest FP8 amax [0-9.e+]+: blocks/(att|ffn)/fp8_\w+ layer \d",
                     result.diagnosis), result.diagnosis
    assert "\n" not in result.diagnosis
    assert all(np.isfinite(np.asarray(m)).all() for m in jax.tree.leaves(result.state.fp8))


def test_checkpointer_refuses_nonfinite_params(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "ck"), CheckpointSection(async_=False))
    state = {"params": {"w": jnp.ones(3), "b": jnp.asarray([0.0, jnp.nan])}}
    with pytest.raises(ValueError, match=r"refusing to save step 7 .*non-finite parameters "
                                         r"\(params/b\)"):
        ckpt.save(7, state, {})
    assert ckpt.latest_step() is None
    ckpt.close()


def test_localiser_names_the_first_op_in_execution_order():
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_embd=64, head_size=32)
    policy = parse_policy("fp32")
    params = nnx.to_pure_dict(nnx.state(RWKV7(cfg, policy, rngs=nnx.Rngs(0)), nnx.Param))
    tokens = jnp.arange(32).reshape(2, 16) % 64
    stats = tap_stats(probe_model_fn(cfg, policy), params, tokens)
    assert first_nonfinite(stats) is None and "finite" in describe(stats, 16)
    # A NaN in layer 1's value projection, at one input channel: first seen in att/v
    params["blocks"]["att"]["value"] = params["blocks"]["att"]["value"].at[1, 3, 0].set(jnp.nan)
    stats = tap_stats(probe_model_fn(cfg, policy), params, tokens)
    line = describe(stats, 16)
    assert first_nonfinite(stats).name == "layer1/att/v"
    assert line.startswith("first non-finite value at layer1/att/v (TimeMix value")
    assert "from position 0 of 16" in line
    names = [s.name for s in stats]
    assert names.index("layer0/att/wkv_out") < names.index("layer1/att/r") < names.index("logits")
