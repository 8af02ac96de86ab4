"""Multi-process training on this machine: two `lwm-jax train` processes joined through
`jax.distributed` over localhost (one CPU device each, gloo collectives) train one run exactly
like one process with two devices: every process reads only its rows of each batch, process 0
alone writes the run's records, each process writes its own checkpoint shards, and the
two-process checkpoint resumes on a single process with one device (another mesh)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from lwm_jax.train.distributed import launch_from_env

SMALL = ["model.n_layer=1", "model.n_embd=64", "model.head_size=32", "runtime.wkv_impl=chunked",
         "train.batch_size=4", "train.ctx_len=32", "train.steps=6", "train.warmup_steps=1",
         "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(subprocess_env, devices: int, **extra) -> dict:
    env = {k: v for k, v in subprocess_env(devices).items() if not k.startswith("LWM_")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def _train(run_dir, env, *args):
    cmd = [sys.executable, "-m", "lwm_jax.cli", "train", "--no-progress", *SMALL,
           f"run_dir={run_dir}", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def _finish(proc, timeout=300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("trainer timed out")
    assert proc.returncode == 0, out[-3000:]
    return out


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_two_devices(tmp_path, subprocess_env):
    one = _finish(_train(tmp_path / "one", _env(subprocess_env, 2), "mesh.data=2"))
    assert "resumed" not in one

    port = _free_port()
    procs = [_train(tmp_path / "two", _env(subprocess_env, 1,
                                           LWM_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                           LWM_NUM_PROCESSES="2", LWM_PROCESS_ID=str(i)),
                    "mesh.data=2", "--stop-after", "4")
             for i in range(2)]
    outs = [_finish(p) for p in procs]
    assert re.search(r"fresh start \(state initialised in [0-9.]+ s\), training to step 4 of 6",
                     outs[0])
    assert "lwm-jax train:" not in outs[1]            # process 1 reports nothing of the run

    # the rest of the run on ONE process with one device, from the two-process checkpoint
    rest = _finish(_train(tmp_path / "two", _env(subprocess_env, 1), "mesh.data=1"))
    assert "resumed at step 4" in rest

    base, split = _records(tmp_path / "one"), _records(tmp_path / "two")
    train_steps = [r["step"] for r in split if "loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]          # each step recorded once
    evals = [r["step"] for r in split if "val_loss" in r]
    assert evals == sorted(set(evals)) and 4 in evals and 6 in evals
    for key in ("loss", "val_loss"):
        want = {r["step"]: r[key] for r in base if key in r}
        got = {r["step"]: r[key] for r in split if key in r}
        assert set(got) <= set(want)
        for step, value in got.items():
            assert value == pytest.approx(want[step], rel=1e-5), (key, step)
    assert os.path.isdir(tmp_path / "two" / "checkpoints" / "6")


@pytest.mark.parametrize("env, message", [
    ({"LWM_COORDINATOR_ADDRESS": "h:1", "LWM_NUM_PROCESSES": "2"},
     "LWM_PROCESS_ID: not set while LWM_COORDINATOR_ADDRESS, LWM_NUM_PROCESSES is"),
    ({"LWM_COORDINATOR_ADDRESS": "h", "LWM_NUM_PROCESSES": "2", "LWM_PROCESS_ID": "0"},
     "LWM_COORDINATOR_ADDRESS: expected host:port, got 'h'"),
    ({"LWM_COORDINATOR_ADDRESS": "h:1", "LWM_NUM_PROCESSES": "two", "LWM_PROCESS_ID": "0"},
     "LWM_NUM_PROCESSES: expected an integer, got 'two'"),
    ({"LWM_COORDINATOR_ADDRESS": "h:1", "LWM_NUM_PROCESSES": "2", "LWM_PROCESS_ID": "2"},
     "LWM_PROCESS_ID: must be in [0, LWM_NUM_PROCESSES=2), got 2"),
])
def test_a_partial_or_bad_launch_is_one_line(env, message):
    with pytest.raises(ValueError) as err:
        launch_from_env(env)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_launch_detection():
    assert launch_from_env({}) is None
    assert launch_from_env({"SLURM_NTASKS": "1"}) is None
    assert launch_from_env({"SLURM_NTASKS": "4"}) == {}
    assert launch_from_env({"TPU_WORKER_HOSTNAMES": "w0,w1"}) == {}
    assert launch_from_env({"TPU_WORKER_HOSTNAMES": "w0"}) is None
    assert launch_from_env({"LWM_COORDINATOR_ADDRESS": "10.0.0.1:1234", "LWM_NUM_PROCESSES": "2",
                            "LWM_PROCESS_ID": "1"}) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}


def test_cloud_tpu_vm_workers_initialise_through_jax(monkeypatch):
    """A TPU VM made with `gcloud compute tpus` sets no variable naming its workers: the
    start-up asks JAX's own detection (metadata server) and then initialises with no
    arguments; elsewhere (this machine) nothing is initialised."""
    import jax
    from lwm_jax.train import distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert distributed._on_cloud_tpu_vm_slice() is False          # not a TPU VM
    assert distributed.initialize_from_env({}) is False and calls == []
    monkeypatch.setattr(distributed, "_on_cloud_tpu_vm_slice", lambda: True)
    assert distributed.initialize_from_env({}) is True and calls == [{}]
