"""Damaged orbax metadata in our own checkpoint directory and in a training run, as convert,
generate and eval read them: one line naming the directory, the damaged file and the fix;
never a traceback, never other weights in silence."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import optax
import pytest

from lwm_jax.cli import main
from lwm_jax.interop import read_params
from lwm_jax.interop.native import save_native
from lwm_jax.interop.orbax_files import pytree_damage, step_damage
from lwm_jax.interop.testing import random_params
from lwm_jax.precision.loss_scale import NoLossScale
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.train.checkpoint import Checkpointer
from lwm_jax.train.config import CheckpointSection, RunConfig
from lwm_jax.train.step import TrainState

CFG = ModelConfig(vocab_size=256, n_layer=1, n_embd=64, head_size=32).resolved()


def truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def not_json(data: bytes) -> bytes:
    return b"\xff\xfe this is not JSON"


# Per file: a value that parses but has the wrong type where orbax indexes into it.
WRONG_TYPE = {
    "_CHECKPOINT_METADATA": b'{"item_handlers": 5}',
    "_METADATA": b'{"tree_metadata": [1, 2]}',
    "_sharding": b'{"params.emb": 5}',
    "process_0": b'{"array_metadatas": {"a": 1}}',
    "metadata": b"[1, 2, 3]",
    "manifest.ocdbt": b'{"not": "a manifest"}',
}


def wrong_type(name: str):
    return lambda data: WRONG_TYPE[name]


def corruptions(files):
    return [pytest.param(f, how, id=f"{f}-{label}") for f in files
            for label, how in (("truncated", truncate), ("not-json", not_json),
                               ("wrong-type", wrong_type(os.path.basename(f))))]


NATIVE_FILES = ["params/_CHECKPOINT_METADATA", "params/_METADATA", "params/manifest.ocdbt"]
RUN_FILES = ["_CHECKPOINT_METADATA", "data/metadata", "state/_METADATA", "state/_sharding",
             "state/array_metadatas/process_0", "state/manifest.ocdbt"]


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=6)


@pytest.fixture(scope="module")
def native(tree, tmp_path_factory):
    return save_native(CFG, tree, tmp_path_factory.mktemp("native") / "ours")


@pytest.fixture(scope="module")
def run(tree, tmp_path_factory):
    """A training run directory with checkpoints at steps 2 and 4 (the trainer's own
    `Checkpointer`: the same orbax layout a training run writes)."""
    run = tmp_path_factory.mktemp("runs") / "run"
    run.mkdir()
    (run / "config.yaml").write_text(RunConfig(model=CFG, run_dir=str(run)).to_yaml())
    ckpt = Checkpointer(str(run / "checkpoints"), CheckpointSection(async_=False))
    for step in (2, 4):
        params = jax.tree.map(lambda x: jnp.asarray(x) * step, tree)
        state = TrainState(jnp.int32(step), params, optax.adamw(1e-3).init(params),
                           NoLossScale(), jax.random.PRNGKey(0))
        ckpt.save(step, state, {"step": step})
    ckpt.close()
    return run


@pytest.fixture
def lambada(tmp_path):
    path = tmp_path / "lambada.jsonl"
    path.write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    return path


def damage(file, how) -> None:
    file.write_bytes(how(file.read_bytes()))


def commands(checkpoint, out, lambada):
    return {"convert": ["convert", "--input", str(checkpoint), "--output", str(out)],
            "generate": ["generate", "--checkpoint", str(checkpoint), "--prompt", "hi"],
            "eval": ["eval", "--checkpoint", str(checkpoint), "--lambada", str(lambada)]}


def error_line(capsys, name) -> str:
    """The one error line on stderr (eval's "[eval] loading ..." progress line aside)."""
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("[eval] ")]
    assert len(err) == 1 and err[0].startswith(f"lwm-jax {name}: error: "), err
    return err[0]


def test_intact_checkpoints_pass_the_checks(native, run):
    assert pytree_damage(native / "params") is None
    assert step_damage(run / "checkpoints" / "4") is None


@pytest.mark.parametrize("rel, how", corruptions(NATIVE_FILES))
def test_damaged_native_metadata_is_one_line(rel, how, native, tmp_path, lambada, capsys):
    ours = tmp_path / "ours"
    shutil.copytree(native, ours)
    damage(ours / rel, how)
    for name, argv in commands(ours, tmp_path / "out", lambada).items():
        assert main(argv) == 2, name
        line = error_line(capsys, name)
        assert f"checkpoint '{ours / 'params'}': cannot restore the orbax checkpoint " \
               f"({os.path.basename(rel)} " in line, line
        assert "it is damaged or incomplete: re-create it (lwm-jax convert)" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rel, how", corruptions(RUN_FILES))
def test_damaged_run_metadata_is_one_line_naming_the_step(rel, how, run, tree, tmp_path,
                                                          lambada, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step4 = copy / "checkpoints" / "4"
    damage(step4 / rel, how)
    for name, argv in commands(copy, tmp_path / "out", lambada).items():
        assert main(argv) == 2, name
        line = error_line(capsys, name)
        assert f"checkpoint '{step4}': {rel}" in line, line
        assert f"remove or restore that directory (the previous complete checkpoint, step 2 " \
               f"in '{copy / 'checkpoints' / '2'}', is read once it is gone)" in line, line
    shutil.rmtree(step4)                                 # the fix the message gives
    _, back = read_params(copy)
    assert (back["emb"] == 2 * tree["emb"]).all()        # step 2's weights


def test_only_checkpoint_damaged_says_so(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "2")
    damage(copy / "checkpoints" / "4" / "state" / "_METADATA", truncate)
    assert main(["convert", "--input", str(copy), "--output", str(tmp_path / "out")]) == 2
    assert "it is the run's only checkpoint" in error_line(capsys, "convert")


def test_damaged_array_data_is_one_line_naming_the_step(run, tmp_path, capsys):
    """A damaged array chunk passes the metadata checks; the restore's failure is one line
    naming the step directory and the previous checkpoint, not tensorstore's spec dump."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    step4 = copy / "checkpoints" / "4"
    chunks = step4 / "state" / "ocdbt.process_0" / "d"
    for chunk in chunks.iterdir():
        chunk.write_bytes(b"xx")
    assert step_damage(step4) is None
    assert main(["generate", "--checkpoint", str(copy), "--prompt", "hi"]) == 2
    line = error_line(capsys, "generate")
    assert f"checkpoint '{step4}': orbax cannot restore it (" in line and "OUT_OF_RANGE" in line
    assert "if the step is damaged, remove or restore that directory" in line, line
    assert "tensorstore_spec" not in line and "See full TensorStore" not in line


@pytest.mark.parametrize("rel", ["commit_success.txt", "state/commit_success.txt",
                                 "state/ocdbt.process_0/manifest.ocdbt"])
def test_files_orbax_never_reads_do_not_count(rel, run, tree, tmp_path):
    """Orbax's commit notes and the per-process manifests it merged when the save finished
    are never read again: damaging them leaves the checkpoint readable (and not refused)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    damage(copy / "checkpoints" / "4" / rel, not_json)
    assert step_damage(copy / "checkpoints" / "4") is None
    _, back = read_params(copy)
    assert (back["emb"] == 4 * tree["emb"]).all()
