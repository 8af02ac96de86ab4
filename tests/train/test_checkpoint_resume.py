"""Checkpoints: exact resume, SIGKILL/SIGTERM, incomplete checkpoints, dtypes, saved config."""
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.precision.loss_scale import DynamicLossScale
from lwm_jax.train.checkpoint import Checkpointer, abstract_with_shardings
from lwm_jax.train.config import CheckpointSection, load_config
from lwm_jax.train.metrics import read_metrics
from lwm_jax.train.optimizer import scale_by_adam_f32
from lwm_jax.train.step import TrainState
from lwm_jax.train.trainer import train

SMALL = ["model.n_layer=2", "model.n_embd=64", "train.ctx_len=32", "train.batch_size=4",
         "train.log_every=1", "train.eval_every=0", "train.warmup_steps=3", "train.lr=1e-3",
         "train.min_lr=1e-4"]
DATA_DOCS = (20, 1000)       # the `data_prefix` fixture (conftest.py): 20 random documents

pytestmark = pytest.mark.usefixtures("compile_cache")


def _steps_on_disk(ckpt_dir):
    """Complete checkpoints = directories named by an integer (orbax renames them into place)."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


@pytest.mark.slow
def test_resume_is_exact(tmp_path, data_prefix):
    common = [*SMALL, "train.steps=20", f"data.path={data_prefix}", "checkpoint.every=5"]
    full = train(load_config(None, [*common, f"run_dir={tmp_path / 'full'}"]), progress=False)
    split_cfg = load_config(None, [*common, f"run_dir={tmp_path / 'split'}"])
    first = train(split_cfg, progress=False, stop_after=10)
    assert first.step == 10 and _steps_on_disk(split_cfg.checkpoint_dir) == [5, 10]
    second = train(split_cfg, progress=False)
    assert full.step == second.step == 20

    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(second.state.params)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)
    opt_full, opt_split = full.state.opt_state, second.state.opt_state
    for a, b in zip(jax.tree.leaves(opt_full), jax.tree.leaves(opt_split)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
    loss_full = [r["loss"] for r in read_metrics(os.path.join(full.run_dir, "metrics.jsonl"))[0]]
    loss_split = [r["loss"] for r in read_metrics(os.path.join(second.run_dir, "metrics.jsonl"))[0]]
    assert len(loss_full) == len(loss_split) == 20
    np.testing.assert_allclose(loss_split, loss_full, rtol=1e-6, atol=0)
    assert abs(second.final_val_loss - full.final_val_loss) <= 1e-6 * full.final_val_loss

    # The run dir holds the config that produced it.
    assert load_config(os.path.join(second.run_dir, "config.yaml")) == split_cfg
    assert os.path.isfile(os.path.join(second.run_dir, "loss_curve.png"))

    # A half-written checkpoint (orbax's temporary directory, never renamed) is never picked.
    fake = os.path.join(split_cfg.checkpoint_dir, "25.orbax-checkpoint-tmp-1234567")
    os.makedirs(os.path.join(fake, "state"))
    with open(os.path.join(fake, "state", "manifest.ocdbt"), "wb") as f:
        f.write(b"\x00partial")
    assert Checkpointer(split_cfg.checkpoint_dir, split_cfg.checkpoint).latest_step() == 20

    # Resuming into a run dir of another model shape is a one-line error, not an orbax trace.
    other = load_config(None, [*common, f"run_dir={tmp_path / 'split'}", "model.n_layer=3"])
    with pytest.raises(ValueError, match=r"^run_dir: .*split holds checkpoints of a run with "
                                         r"model\.n_layer=2; resume with the same settings"):
        train(other, progress=False)


def test_checkpoint_keeps_dtypes_and_loss_scale(tmp_path):
    params = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 7,
              "blocks": {"w0": jnp.linspace(-1, 1, 4, dtype=jnp.float32)}}
    tx = scale_by_adam_f32(0.9, 0.99, 1e-18)
    ls = DynamicLossScale.create(initial_scale=1024.0)
    state = TrainState(jnp.asarray(7, jnp.int32), params, tx.init(params), ls,
                       jax.random.PRNGKey(3))
    ckpt = Checkpointer(str(tmp_path / "ck"), CheckpointSection(keep=2))
    for step in (7, 8, 9):
        assert ckpt.save(step, state, {"step": step})
    assert not ckpt.save(9, state, {"step": 9})        # an existing step is not rewritten
    ckpt.wait()
    assert ckpt.all_steps() == [8, 9]                    # keep-last-2
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored, data = ckpt.restore(9, abstract_with_shardings(state, jax.tree.map(lambda _: sh,
                                                                                 state)))
    ckpt.close()
    assert data == {"step": 9}
    assert restored.params["w"].dtype == jnp.bfloat16
    assert restored.opt_state.mu["w"].dtype == jnp.float32
    assert float(restored.loss_scale.scale) == 1024.0 and restored.loss_scale.growth_interval == 2000
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _start(run_dir, data_prefix, cache_dir, steps=100000, extra=()):
    cmd = [sys.executable, "-m", "lwm_jax.cli", "train", "--no-progress",
           *_killed_run(run_dir, data_prefix, steps, extra)]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def _killed_run(run_dir, data_prefix, steps, extra=()):
    """The overrides of the runs the signal tests start (and repeat in process)."""
    return [*SMALL, f"train.steps={steps}", "train.log_every=50", f"data.path={data_prefix}",
            "checkpoint.every=3", f"run_dir={run_dir}", *extra]


def _wait_for(pred, proc, timeout=120.0):
    t0 = time.time()
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early:\n{proc.stdout.read()}")
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the trainer")
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_resumes_from_last_complete_checkpoint_and_sigterm_saves(tmp_path, data_prefix,
                                                                         compile_cache):
    run_dir = str(tmp_path / "run")
    ckpt_dir = os.path.join(run_dir, "checkpoints")

    # 1) SIGKILL once a checkpoint exists: no chance to clean up.
    proc = _start(run_dir, data_prefix, compile_cache)
    _wait_for(lambda: _steps_on_disk(ckpt_dir), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    complete = _steps_on_disk(ckpt_dir)
    assert complete

    # 2) The same command resumes from the newest complete checkpoint ...
    proc = _start(run_dir, data_prefix, compile_cache)
    _wait_for(lambda: max(_steps_on_disk(ckpt_dir)) > complete[-1], proc)
    # 3) ... and SIGTERM makes it save where it is and exit with 128 + SIGTERM.
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert f"resumed at step {complete[-1]}," in out, out
    match = re.search(r"SIGTERM received; checkpoint saved at step (\d+)", out)
    assert match, out
    stopped = int(match.group(1))
    assert stopped > complete[-1] and _steps_on_disk(ckpt_dir)[-1] == stopped

    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
    assert ckpt.latest_step() == stopped
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))[0]
    assert records and all(np.isfinite(r["loss"]) for r in records)
    ckpt.close()


def test_run_dir_is_locked_and_a_finished_run_writes_nothing(tmp_path, data_prefix, capsys):
    from lwm_jax.train.run_lock import RunDirLock
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*SMALL, "train.steps=3", f"data.path={data_prefix}",
                             f"run_dir={run_dir}"])
    os.makedirs(run_dir)
    with RunDirLock(str(run_dir)):       # another process holding the run dir
        with pytest.raises(ValueError, match=r"run_dir: .* is in use by pid \d+ on .*; wait"):
            train(cfg, progress=False)
    first = train(cfg, progress=False)   # the lock was released: a stale lock never blocks
    assert first.step == 3 and first.stopped_by is None
    before = {p: os.path.getmtime(run_dir / p) for p in ("metrics.jsonl", "config.yaml")}
    again = train(cfg, progress=False)
    assert again.stopped_by == "complete" and again.step == 3 and again.state is None
    assert "already complete (checkpoint at step 3 of 3); nothing to do" in capsys.readouterr().out
    assert {p: os.path.getmtime(run_dir / p) for p in before} == before


def test_checkpoint_dir_elsewhere_is_locked_with_the_run(tmp_path, data_prefix):
    """A second run with its own run dir but the first's `checkpoint.dir` resumed the other
    run's checkpoints and wrote into them while it ran; the checkpoint dir is now locked too."""
    from lwm_jax.train.run_lock import RunDirLock
    shared = tmp_path / "ckpts"
    cfg = load_config(None, [*SMALL, "train.steps=3", f"data.path={data_prefix}",
                             f"run_dir={tmp_path / 'b'}", f"checkpoint.dir={shared}"])
    os.makedirs(shared)
    with RunDirLock(str(shared), "checkpoint.dir"):      # run a, still training
        with pytest.raises(ValueError, match=r"checkpoint.dir: .* is in use by pid \d+ on .*"):
            train(cfg, progress=False)
    assert not os.path.exists(tmp_path / "b" / "config.yaml")
    assert train(cfg, progress=False).step == 3          # free again: it runs (and resumes later)


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", ".lock", "loss_curve.png"])
def test_nothing_is_written_through_a_planted_symlink(tmp_path, data_prefix, name):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir)
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    os.symlink(target, run_dir / name)
    cfg = load_config(None, [*SMALL, "train.steps=3", f"data.path={data_prefix}",
                             f"run_dir={run_dir}"])
    with pytest.raises(ValueError, match=rf"{re.escape(name)} is a symbolic link"):
        train(cfg, progress=False)
    assert target.read_text() == "precious\n"


def test_a_torn_metrics_line_is_skipped_with_a_warning_and_repaired(tmp_path, data_prefix):
    """A writer killed mid-line left `{"step": 3, "lo` at the end of metrics.jsonl: every later
    resume ended in exit 2 with an unnamed JSON error and no loss curve."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*SMALL, "train.steps=4", f"data.path={data_prefix}",
                             f"run_dir={run_dir}"])
    train(cfg, progress=False, stop_after=2)
    metrics = run_dir / "metrics.jsonl"
    with open(metrics, "a", encoding="utf-8") as f:
        f.write('{"step": 3, "lo')                       # the torn last line
    with pytest.warns(RuntimeWarning, match=r"1 damaged line\(s\) skipped"):
        result = train(cfg, progress=False)
    assert result.step == 4 and os.path.isfile(run_dir / "loss_curve.png")
    lines = metrics.read_text().splitlines()
    assert '{"step": 3, "lo' in lines                  # kept as it was, on a line of its own
    steps = [r["step"] for r in read_metrics(str(metrics))[0]]
    assert steps[-1] == 4


@pytest.mark.slow
def test_fp8_sigkill_then_resume_is_exact(tmp_path, data_prefix, compile_cache):
    """Under fp8-mixed, a run killed with SIGKILL after a checkpoint and started again with the
    same settings reaches step k + 4 exactly as an uninterrupted run does: parameters,
    optimizer moments and the FP8 scaling state (amax histories and scales) alike."""
    fp8 = ["precision=fp8-mixed"]
    killed_dir = str(tmp_path / "killed")
    proc = _start(killed_dir, data_prefix, compile_cache, steps=200, extra=fp8)
    ckpt_dir = os.path.join(killed_dir, "checkpoints")
    _wait_for(lambda: _steps_on_disk(ckpt_dir), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    k = _steps_on_disk(ckpt_dir)[-1]
    assert k < 196
    resumed = train(load_config(None, _killed_run(killed_dir, data_prefix, 200, fp8)),
                    progress=False, stop_after=4)
    full = train(load_config(None, _killed_run(str(tmp_path / "full"), data_prefix, 200, fp8)),
                 progress=False, stop_after=k + 4)
    assert resumed.step == full.step == k + 4
    assert full.state.fp8 is not None
    for a, b in zip(jax.tree.leaves((full.state.params, full.state.opt_state, full.state.fp8)),
                    jax.tree.leaves((resumed.state.params, resumed.state.opt_state,
                                     resumed.state.fp8))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
