"""`lwm-jax train` with no --config: the tiny run on the embedded corpus, shrunk, end to end."""
import json
import os
import subprocess
import sys
import time

import pytest

from lwm_jax.train.metrics import MetricsLogger, peak_flops_per_device, read_metrics

SHRINK = ["model.n_layer=2", "model.n_embd=64", "train.ctx_len=64", "train.batch_size=8",
          "train.steps=40", "train.warmup_steps=5", "train.eval_every=20", "train.log_every=5",
          "checkpoint.every=20"]


@pytest.mark.slow
def test_default_run_from_any_directory_lowers_validation_loss(tmp_path):
    env = {**os.environ, "LWM_JAX_CACHE": str(tmp_path / "cache"),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-compile")}
    work = tmp_path / "elsewhere"          # not the repository: defaults come from the package
    work.mkdir()
    out = subprocess.run([sys.executable, "-m", "lwm_jax.cli", "train", "--no-progress",
                          *SHRINK], cwd=work, env=env, capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = work / "runs" / "tiny"
    assert "embedded Python-stdlib corpus" in out.stdout
    assert "lwm-jax train: step 40, validation loss" in out.stdout

    train_recs, evals = read_metrics(str(run_dir / "metrics.jsonl"))
    val = {r["step"]: r["val_loss"] for r in evals}
    assert sorted(val) == [0, 20, 40]
    assert 5.0 < val[0] < 6.0                         # ~ln(256): an untrained byte model
    assert val[40] < val[20] < val[0] and val[40] < 0.75 * val[0], val
    assert [r["step"] for r in train_recs] == list(range(5, 41, 5))
    for r in train_recs[1:]:                          # throughput after the compiling step
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None  # CPU: no peak
        assert 0 < r["lr"] <= 3e-3 and r["grad_norm"] > 0
    assert "loss_scale" not in train_recs[0]          # fp32 run: no loss scaling fields

    with open(run_dir / "loss_curve.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.yaml").is_file()
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["20", "40"]
    if _importable("tensorboardX"):                  # the default trackers: jsonl, tensorboard
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir / "tb"))
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert all(r["step"] >= 0 for r in records)
    assert records[0]["config"]["name"] == "tiny"     # the run config, once, first
    assert all(r["loss_mean"] > 0 for r in train_recs)


def _importable(mod):
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


class _FakeDevice:
    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


def test_peak_flops_lookup():
    assert peak_flops_per_device(_FakeDevice("gpu", "NVIDIA H100 80GB HBM3")) == 989e12
    assert peak_flops_per_device(_FakeDevice("gpu", "NVIDIA H200")) == 989e12
    assert peak_flops_per_device(_FakeDevice("tpu", "TPU v5 lite")) == 197e12
    assert peak_flops_per_device(_FakeDevice("tpu", "TPU v5p")) == 459e12
    assert peak_flops_per_device(_FakeDevice("gpu", "NVIDIA GeForce GTX 1080")) is None
    assert peak_flops_per_device(_FakeDevice("cpu", "cpu")) is None


def test_throughput_and_mfu_arithmetic(tmp_path):
    logger = MetricsLogger(str(tmp_path), n_params=2_000_000, tokens_per_step=4096,
                           total_steps=10, progress=False, fp16=True)
    logger.peak = 1e12                               # pretend: a 1 TFLOP/s device
    logger.reset_timer(0)
    time.sleep(0.2)
    rec = logger.log_train(3, {"loss": 2.0, "lr": 1e-3, "grad_norm": float("inf"),
                               "loss_scale": 1024.0, "finite": 0.0, "skipped_steps": 1.0})
    logger.close()
    assert 3 * 4096 / 0.5 < rec["tokens_per_s"] < 3 * 4096 / 0.2
    assert rec["tflops"] == pytest.approx(6 * 2e6 * rec["tokens_per_s"] / 1e12)
    assert rec["mfu"] == pytest.approx(rec["tflops"] * 1e12 / (1e12 * logger.n_devices))
    assert rec["loss_scale"] == 1024.0 and rec["skipped_steps"] == 1
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0] == [{**rec, "grad_norm": None}]


@pytest.mark.parametrize("progress", [True, False])
def test_off_a_terminal_each_train_record_is_one_plain_line(tmp_path, capsys, progress):
    """Under nohup / sbatch the bar's carriage returns filled the log, and --no-progress
    printed no loss or tokens/s at all: off a terminal (pytest's captured stderr is not one)
    every train record is one line, with or without --no-progress."""
    logger = MetricsLogger(str(tmp_path), n_params=2_000_000, tokens_per_step=4096,
                           total_steps=10, progress=progress)
    logger.reset_timer(0)
    logger.log_train(5, {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "loss_scale": 1.0,
                         "finite": 1.0, "skipped_steps": 0.0})
    logger.close()
    captured = capsys.readouterr()
    lines = [ln for ln in captured.out.splitlines() if ln.startswith("step 5:")]
    assert len(lines) == 1 and "loss 2.5000" in lines[0] and "tokens/s" in lines[0]
    assert "\r" not in captured.err
