"""Trackers (`logging.trackers`): metrics.jsonl, TensorBoard (tensorboardX) and Weights &
Biases (offline) get every record, the running-mean loss and the run config; only process 0
writes; a missing package is one line (tensorboard) or a one-line error (wandb)."""
import glob
import json
import os
import struct

import jax.numpy as jnp
import pytest

from lwm_jax.train import trackers
from lwm_jax.train.config import load_config
from lwm_jax.train.metrics import MetricsLogger, read_metrics
from lwm_jax.train.trainer import train

LLAMA_RUN = ["arch=llama", "model.n_layer=1", "model.n_embd=64", "model.n_head=2",
             "model.n_kv_head=1", "model.head_dim=32", "model.ffn_hidden=128",
             "model.max_seq_len=64", "train.ctx_len=32", "train.batch_size=2",
             "train.steps=4", "train.warmup_steps=1", "train.log_every=2", "train.eval_every=2",
             "train.eval_batches=1", "checkpoint.every=0", "checkpoint.async=false"]


def tfevents(directory):
    """`{(tag, step): value}` of the scalars and `{tag: text}` of the text summaries in the
    TFRecord event files under `directory` (length, crc, payload, crc per record)."""
    from tensorboardX.proto.event_pb2 import Event
    scalars, texts = {}, {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("tensor") and v.tensor.string_val:
                    texts[v.tag] = v.tensor.string_val[0].decode()
                else:
                    scalars[(v.tag, event.step)] = v.simple_value
    return scalars, texts


def wandb_records(run_dir):
    """(config updates `{key: value}`, history rows `[{key: value}]`) of the offline W&B run
    under `run_dir`, read from its `.wandb` log (7-byte file header, then 32 KiB blocks of
    records with a 7-byte header: crc, length, kind 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, parts, config, history = 7, 32768, [], {}, []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record.FromString(b"".join(parts))
            parts = []
            which = record.WhichOneof("record_type")
            if which == "config":
                config.update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif which == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in record.history.item})
    return config, history


def test_records_and_config_reach_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")
    logger = MetricsLogger(str(tmp_path), n_params=1000, tokens_per_step=64, total_steps=6,
                           progress=False,
                           trackers=trackers.make_trackers(["jsonl", "tensorboard"],
                                                           str(tmp_path)))
    logger.log_config(0, {"name": "x", "train": {"lr": 0.25}})
    step_metrics = lambda loss, finite=1.0: {  # noqa: E731 (device scalars, as the step's)
        "loss": jnp.float32(loss), "finite": jnp.float32(finite), "lr": jnp.float32(1e-3),
        "grad_norm": jnp.float32(1.0), "skipped_steps": jnp.float32(1 - finite)}
    for loss, finite in ((1.0, 1.0), (2.0, 1.0), (float("nan"), 0.0), (3.0, 1.0)):
        logger.advance(metrics=step_metrics(loss, finite))
    first = logger.log_train(4, step_metrics(3.0))
    logger.log_eval(4, 1.5)
    for loss in (4.0, 6.0):
        logger.advance(metrics=step_metrics(loss))
    second = logger.log_train(6, step_metrics(6.0))
    logger.close()
    assert (first["loss"], first["loss_mean"]) == (3.0, 2.0)     # the skipped NaN step is out
    assert second["loss_mean"] == 5.0                            # a new window per record

    with open(tmp_path / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert lines[0] == {"step": 0, "config": {"name": "x", "train": {"lr": 0.25}}}
    train_recs, evals = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["loss_mean"] for r in train_recs] == [2.0, 5.0]
    assert evals == [{"step": 4, "val_loss": 1.5}]

    scalars, texts = tfevents(tmp_path / "tb")
    assert scalars[("train/loss_mean", 4)] == 2.0 and scalars[("train/loss_mean", 6)] == 5.0
    assert scalars[("train/loss", 6)] == 6.0 and scalars[("val_loss", 4)] == 1.5
    assert ("train/mfu", 4) not in scalars                       # None (CPU) is left out
    assert "lr: 0.25" in texts["config/text_summary"]


def test_other_processes_write_nothing(tmp_path):
    logger = MetricsLogger(str(tmp_path), n_params=1000, tokens_per_step=64, total_steps=2,
                           progress=False, write=False)
    logger.log_config(0, {"name": "x"})
    logger.advance(metrics={"loss": jnp.float32(1.0), "finite": jnp.float32(1.0)})
    logger.log_train(1, {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "skipped_steps": 0.0})
    logger.log_eval(1, 1.0)
    logger.close()
    assert os.listdir(tmp_path) == [] and logger.path is None


def test_a_missing_tracker_package(tmp_path, monkeypatch):
    real = trackers._installed
    monkeypatch.setattr(trackers, "_installed", lambda m: False if m in ("tensorboardX", "wandb")
                        else real(m))
    notes = trackers.check_trackers(["jsonl", "tensorboard"])
    assert len(notes) == 1 and "tensorboardX is not installed" in notes[0]
    made = trackers.make_trackers(["jsonl", "tensorboard"], str(tmp_path))
    assert [t.name for t in made] == ["jsonl"]
    made[0].close()
    with pytest.raises(ValueError) as err:
        trackers.check_trackers(["jsonl", "wandb"])
    assert str(err.value).startswith("logging.trackers: wandb is not installed; pip install")
    assert "\n" not in str(err.value)


def test_a_training_run_feeds_every_tracker_and_profiles_its_window(tmp_path, monkeypatch,
                                                                    capsys):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("wandb", reason="wandb is in [dev] and [trackers]")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    cfg = load_config(None, LLAMA_RUN + [f"run_dir={run_dir}", "train.profile_steps=[1, 3]",
                                         "logging.trackers=[jsonl, tensorboard, wandb]"])
    assert train(cfg, progress=False).step == 4

    with open(run_dir / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first == {"step": 0, "config": cfg.to_dict()}
    train_recs, evals = read_metrics(str(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in train_recs] == [2, 4] and [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["loss_mean"] > 0 for r in train_recs)

    scalars, texts = tfevents(run_dir / "tb")
    assert scalars[("train/loss_mean", 4)] == pytest.approx(train_recs[1]["loss_mean"])
    assert "arch: llama" in texts["config/text_summary"]

    config, history = wandb_records(str(run_dir))
    assert config["arch"] == "llama" and config["train"]["profile_steps"] == [1, 3]
    logged = {row["_step"]: row for row in history}
    assert logged[4]["train/loss_mean"] == pytest.approx(train_recs[1]["loss_mean"])
    assert logged[2]["val_loss"] == pytest.approx(evals[1]["val_loss"])
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}"))

    # the profile window: steps 1 and 2 of the train step, nothing else of it
    (trace,) = glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" /
                              "perfetto_trace.json.gz"))
    import gzip
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    runs = {e["args"]["run_id"] for e in events
            if e.get("args", {}).get("hlo_module") == "jit_step" and "run_id" in e["args"]}
    assert len(runs) == 2

    # tensorboard asked for without tensorboardX: one line, once (the run is complete)
    capsys.readouterr()
    real = trackers._installed
    monkeypatch.setattr(trackers, "_installed", lambda m: m != "tensorboardX" and real(m))
    assert train(cfg, progress=False).stopped_by == "complete"
    lines = capsys.readouterr().out.splitlines()
    assert sum("tensorboardX is not installed" in line for line in lines) == 1
