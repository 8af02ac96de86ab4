"""Paths that are not valid UTF-8 (`$'/tmp/x\\xff'`, carried in a Python str as surrogates):
convert, export and generate work on them (orbax through a UTF-8 alias, torch through an open
file), and where no alias can be made the refusal is one line naming the flag and the fix."""
from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import optax
import pytest

from lwm_jax.cli import main
from lwm_jax.interop import hf, read_params
from lwm_jax.interop.native import save_native
from lwm_jax.interop.params import flatten
from lwm_jax.interop.testing import random_params
from lwm_jax.precision.loss_scale import NoLossScale
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.train.checkpoint import Checkpointer
from lwm_jax.train.config import CheckpointSection, RunConfig
from lwm_jax.train.step import TrainState

CFG = ModelConfig(vocab_size=256, n_layer=1, n_embd=64, head_size=32).resolved()
BAD = os.fsdecode(b"ck\xff")           # a directory name in Latin-1, not UTF-8


def same(a: dict, b: dict, layer0_value: bool = True) -> bool:
    """Equal trees; `layer0_value=False`: layer 0's unused v0/v1/v2, which the HF layout does
    not store, are compared from layer 1 on."""
    fa, fb = flatten(a), flatten(b)
    skip = () if layer0_value else ("blocks/att/v0", "blocks/att/v1", "blocks/att/v2")
    return sorted(fa) == sorted(fb) and all(
        (jnp.asarray(fa[k])[int(k in skip):] == jnp.asarray(fb[k])[int(k in skip):]).all()
        for k in fa)


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=4)


@pytest.fixture(scope="module")
def sources(tree, tmp_path_factory):
    """A .pth, an HF directory, our own directory and a training run, all under a directory
    whose name is not UTF-8 (orbax cannot write there, so ours and the run are written under a
    UTF-8 name and moved)."""
    root = tmp_path_factory.mktemp("sources")
    bad = root / BAD
    bad.mkdir()
    pytest.importorskip("torch")
    from lwm_jax.interop.rwkv_pth import save_pth
    save_pth(CFG, tree, bad / "m.pth", dtype="f32")
    hf.write_hf(CFG, tree, bad / "hf")
    save_native(CFG, tree, root / "ours")
    os.rename(root / "ours", bad / "ours")
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(RunConfig(model=CFG, run_dir=str(run)).to_yaml())
    params = jax.tree.map(jnp.asarray, tree)
    state = TrainState(jnp.int32(2), params, optax.adamw(1e-3).init(params), NoLossScale(),
                       jax.random.PRNGKey(0))
    ckpt = Checkpointer(str(run / "checkpoints"), CheckpointSection(async_=False))
    ckpt.save(2, state, {"step": 2})
    ckpt.close()
    os.rename(run, bad / "run")
    return bad


def one_line(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("kind", ["m.pth", "hf", "ours", "run"])
def test_convert_from_and_to_non_utf8_directories(kind, sources, tree, tmp_path, capsys):
    out = tmp_path / BAD / "converted"
    status = main(["convert", "--input", str(sources / kind), "--output", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out.strip() == f"wrote {tmp_path}/ck\\xff/converted"   # printable
    cfg, back = read_params(out)
    assert cfg == CFG and same(back, tree, layer0_value=kind != "hf")
    assert "ck\\uDCFF" in (out / "config.yaml").read_text()    # the source, escaped by YAML
    assert not any(name.startswith("lwm-utf8-") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("kind", ["m.pth", "hf", "ours", "run"])
def test_generate_from_a_non_utf8_checkpoint(kind, sources, capsys):
    status = main(["generate", "--checkpoint", str(sources / kind), "--prompt", "hi",
                   "--max-new-tokens", "2", "--no-echo"])
    err = one_line(capsys)
    assert status == 0 and len(err) == 1 and err[0].startswith("[generate]"), err


@pytest.mark.parametrize("name", ["missing", "missing.pth"])
def test_a_missing_non_utf8_checkpoint_is_one_line(name, tmp_path, capsys):
    path = tmp_path / BAD / name
    assert main(["generate", "--checkpoint", str(path), "--prompt", "hi"]) == 2
    err = one_line(capsys)
    assert len(err) == 1 and "no such file or directory" in err[0], err


def test_export_to_non_utf8_paths(sources, tree, tmp_path, capsys):
    out = tmp_path / BAD
    assert main(["export", "--input", str(sources / "ours"), "--output", str(out / "m.pth"),
                 "--format", "rwkv-pth", "--dtype", "f32"]) == 0
    assert main(["export", "--input", str(sources / "run"), "--output", str(out / "hf"),
                 "--format", "hf"]) == 0
    assert capsys.readouterr().out.count("ck\\xff") == 2
    assert same(read_params(out / "m.pth")[1], tree)
    assert (out / "hf" / "tokenizer.json").is_file()            # byte-level: vocab 256
    assert same(read_params(out / "hf")[1], tree, layer0_value=False)


def test_without_a_utf8_alias_the_refusal_is_one_line(sources, tmp_path, monkeypatch, capsys):
    """Where no symbolic link can be made, orbax cannot be given the directory at all: the
    command stops before writing, in one line naming the flag's key and the fix."""
    def no_links(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "symlink", no_links)
    out = tmp_path / BAD / "converted"
    assert main(["convert", "--input", str(sources / "hf"), "--output", str(out)]) == 2
    err = one_line(capsys)
    assert len(err) == 1 and "output_dir:" in err[0] and "not valid UTF-8" in err[0] \
        and "rename the directory to UTF-8" in err[0], err
    assert not (out / "params").exists()
    assert main(["generate", "--checkpoint", str(sources / "ours"), "--prompt", "hi"]) == 2
    err = one_line(capsys)
    assert len(err) == 1 and "checkpoint:" in err[0] and "rename the directory" in err[0], err
    shutil.rmtree(tmp_path / BAD)
