"""Resuming a run whose newest checkpoints are damaged (metadata truncated, not JSON or of the
wrong type; array chunks cut short): training resumes from the newest INTACT checkpoint with a
warning naming each damaged one, which is moved aside, never deleted; where that cannot be
done, one line names the step directory and the fix."""
from __future__ import annotations

import os
import shutil

import jax
import pytest

from lwm_jax.cli import main
from lwm_jax.train.checkpoint import Checkpointer
from lwm_jax.train.config import CheckpointSection, load_config
from lwm_jax.train.metrics import read_metrics
from lwm_jax.train.trainer import train

SMALL = ["model.n_layer=1", "model.n_embd=64", "train.ctx_len=16", "train.batch_size=2",
         "train.log_every=1", "train.eval_every=0", "train.warmup_steps=1",
         "checkpoint.every=2", "checkpoint.async=false"]

WRONG_TYPE = {"_CHECKPOINT_METADATA": b'{"commit_timestamp_nsecs": "soon"}',
              "metadata": b'"a string"', "_METADATA": b'{"tree_metadata": {"x": []}}',
              "_sharding": b"[]", "process_0": b'{"array_metadatas": [1]}',
              "manifest.ocdbt": b"{}"}
CORRUPTIONS = {"truncated": lambda name, data: data[: len(data) // 2],
               "not-json": lambda name, data: b"\x00\xff garbage",
               "wrong-type": lambda name, data: WRONG_TYPE[name]}
FILES = ["_CHECKPOINT_METADATA", "data/metadata", "state/_METADATA", "state/_sharding",
         "state/array_metadatas/process_0", "state/manifest.ocdbt"]
DATA_DOCS = (10, 400)        # the `data_prefix` fixture (conftest.py): 10 random documents

pytestmark = pytest.mark.usefixtures("compile_cache")


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_prefix):
    """A real training run with checkpoints at steps 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    train(load_config(None, [*SMALL, "train.steps=6", f"data.path={data_prefix}",
                             f"run_dir={run_dir}"]), progress=False)
    assert _steps(run_dir / "checkpoints") == ["2", "4", "6"]
    return run_dir


def _steps(ckpt_dir) -> list[str]:
    return sorted(os.listdir(ckpt_dir), key=lambda n: (len(n), n))


def _copy(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, copy / "checkpoints"


def _damage(step_dir, rel, how="truncated") -> bytes:
    file = step_dir / rel
    data = CORRUPTIONS[how](os.path.basename(rel), file.read_bytes())
    file.write_bytes(data)
    return data


def _cut_arrays(step_dir) -> None:
    """Cut every array chunk of the step short: its metadata stays intact."""
    for chunk in (step_dir / "state" / "ocdbt.process_0" / "d").iterdir():
        chunk.write_bytes(b"xx")


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("rel", FILES)
def test_each_damaged_metadata_file_is_moved_aside_with_a_warning(rel, how, run, tmp_path):
    _, ckpts = _copy(run, tmp_path)
    data = _damage(ckpts / "6", rel, how)
    pattern = (rf"checkpoint: step 6 in {ckpts} is damaged \({rel} .+\); moved it to "
               rf"{ckpts}/6\.damaged and resuming from step 4, the newest intact checkpoint")
    with pytest.warns(RuntimeWarning, match=pattern):
        ckpt = Checkpointer(str(ckpts), CheckpointSection(async_=False))
    try:
        assert ckpt.latest_step() == 4 and ckpt.all_steps() == [2, 4]
        assert ckpt.moved_aside == {6: f"{ckpts}/6.damaged"}
        assert (ckpts / "6.damaged" / rel).read_bytes() == data     # kept as it was
        assert _steps(ckpts) == ["2", "4", "6.damaged"]
    finally:
        ckpt.close()


def test_resume_falls_back_past_damaged_metadata_and_damaged_arrays(run, data_prefix,
                                                                    tmp_path, capfd):
    """`lwm-jax train` over step 6 (damaged metadata: moved aside when the checkpoints are
    opened) and step 4 (array chunks cut short: found by the restore, moved aside then)
    resumes from step 2, saves steps 4, 6 and 8 again, and prints no orbax noise."""
    copy, ckpts = _copy(run, tmp_path)
    _damage(ckpts / "6", "state/_METADATA")
    _cut_arrays(ckpts / "4")
    argv = ["train", *SMALL, "train.steps=8", f"data.path={data_prefix}", f"run_dir={copy}",
            "--no-progress"]
    with pytest.warns(RuntimeWarning) as caught:
        assert main(argv) == 0
    messages = [str(w.message) for w in caught if "checkpoint: step" in str(w.message)]
    assert len(messages) == 2, messages
    assert "step 6 in" in messages[0] and "state/_METADATA is not valid JSON" in messages[0]
    assert "resuming from step 4" in messages[0]
    assert "step 4 in" in messages[1] and "an array cannot be read: OUT_OF_RANGE" in messages[1]
    assert "resuming from step 2" in messages[1]
    out, err = capfd.readouterr()
    assert "resumed at step 2, training to step 8" in out, out
    assert "Traceback" not in err and "Exception ignored" not in err and \
        "Task exception" not in err, err[:2000]
    assert _steps(ckpts) == ["4", "6", "8", "4.damaged", "6.damaged"]   # keep=3: 2 retired
    steps = [r["step"] for r in read_metrics(str(copy / "metrics.jsonl"))[0]]
    assert steps == list(range(1, 9))


def test_no_intact_checkpoint_left_is_one_line(run, data_prefix, tmp_path, capsys):
    copy, ckpts = _copy(run, tmp_path)
    for step, rel in (("2", "data/metadata"), ("4", "state/_sharding"),
                      ("6", "_CHECKPOINT_METADATA")):
        _damage(ckpts / step, rel, "not-json")
    argv = ["train", *SMALL, "train.steps=8", f"data.path={data_prefix}", f"run_dir={copy}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"checkpoint: every checkpoint in {ckpts} is damaged (step 6: _CHECKPOINT_METADATA " \
           "is not UTF-8 text (byte 1)); remove or restore them" in err[0], err
    assert _steps(ckpts) == ["2", "4", "6"]                  # nothing moved


def test_a_multi_process_run_moves_nothing(run, tmp_path, monkeypatch):
    _, ckpts = _copy(run, tmp_path)
    _damage(ckpts / "6", "state/_METADATA", "wrong-type")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError) as info:
        Checkpointer(str(ckpts), CheckpointSection(async_=False))
    text = str(info.value)
    assert "\n" not in text and f"step 6 in {ckpts} is damaged (state/_METADATA " \
           "tree_metadata['x'] is an array, expected an object" in text and \
           f"remove or restore {ckpts}/6 and run the same command again to resume from " \
           "step 4, the newest intact checkpoint" in text, text
    assert _steps(ckpts) == ["2", "4", "6"]


def test_damaged_arrays_with_nothing_older_are_one_line(run, data_prefix, tmp_path, capsys):
    copy, ckpts = _copy(run, tmp_path)
    for step in ("4", "6"):
        shutil.rmtree(ckpts / step)
    _cut_arrays(ckpts / "2")
    argv = ["train", *SMALL, "train.steps=8", f"data.path={data_prefix}", f"run_dir={copy}",
            "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"checkpoint: step 2 in {ckpts}/2 is damaged (an array cannot be read: " \
           "OUT_OF_RANGE" in err[0], err
    assert "remove it or restore it from a copy and run the same command again (with no " \
           "older checkpoint it then starts afresh)" in err[0], err
    assert _steps(ckpts) == ["2"]
