"""Training the LLaMA family through `lwm-jax train`'s code path: `arch: llama` configs,
loss going down, exact resume, and the run dir refusing another family."""
import os

import jax
import numpy as np
import pytest
import yaml

from lwm_jax.models.llama import Llama, LlamaConfig, RopeScaling
from lwm_jax.train.config import build_config, load_config
from lwm_jax.train.metrics import read_metrics
from lwm_jax.train.trainer import _check_same_model, build_program, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "llama-tiny.yaml")
SMALL = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.n_kv_head=1",
         "model.head_dim=32", "model.ffn_hidden=128", "train.ctx_len=32", "train.batch_size=4",
         "train.log_every=1", "train.eval_every=0", "train.warmup_steps=2", "train.lr=1e-2",
         "train.min_lr=3e-3", "train.steps=12", "checkpoint.every=6", "train.loss_chunk=64"]


def _motif_docs(rng):
    """Documents that repeat a short motif over 16 symbols: learnable within a few steps."""
    return [np.tile(rng.integers(1, 17, rng.integers(3, 7)), 60)[:300] for _ in range(24)]


DATA_DOCS = _motif_docs      # the `data_prefix` fixture (conftest.py)

pytestmark = pytest.mark.usefixtures("compile_cache")    # the three runs below share programs


def test_llama_config_parses_and_builds_the_llama_model():
    cfg = load_config(TINY)
    assert cfg.arch == "llama" and isinstance(cfg.model, LlamaConfig)
    assert 1_000_000 <= cfg.model.param_count() <= 4_000_000
    assert build_config(cfg.to_dict()) == cfg
    cfg = load_config(TINY, ["model.rope_scaling={kind: linear, factor: '2e0'}",
                             "model.rms_eps=1e-6"])
    assert cfg.model.rope_scaling == RopeScaling("linear", 2.0) and cfg.model.rms_eps == 1e-6
    prog = build_program(load_config(TINY, SMALL))
    assert "blocks/attn/q" in prog.axes and prog.axes["embed"] == ("vocab", "embed")
    assert type(prog.fresh_state).__name__ == "function"
    assert load_config(None).arch == "rwkv7"          # the default family is unchanged


@pytest.mark.parametrize("overrides, message", [
    (["model.n_heads=2"], r"model.n_heads: unknown key; valid keys: ffn_hidden, .* \(model keys "
                          r"of arch llama\)"),
    (["model.n_kv_head=3"], "model.n_kv_head: 3 does not divide model.n_head=4"),
    (["model.rope_scaling={kind: yarn}"], "model.rope_scaling.kind: 'yarn' is not one of"),
    (["model.rope_scaling={factor: fast}"], "model.rope_scaling.factor: expected a number"),
    (["arch=gpt"], "arch: 'gpt' is not one of rwkv7, llama"),
    (["arch=rwkv7"], r"model.ffn_hidden: unknown key; .* \(model keys of arch rwkv7\)"),
])
def test_llama_config_errors_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        load_config(TINY, overrides)
    assert "\n" not in str(err.value)


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path, data_prefix):
    common = [*SMALL, f"data.path={data_prefix}", "data.val_fraction=0.1"]
    full = train(load_config(TINY, [*common, f"run_dir={tmp_path / 'full'}"]), progress=False)
    split_cfg = load_config(TINY, [*common, f"run_dir={tmp_path / 'split'}"])
    assert train(split_cfg, progress=False, stop_after=6).step == 6
    second = train(split_cfg, progress=False)
    assert full.step == second.step == 12

    losses = [r["loss"] for r in read_metrics(os.path.join(full.run_dir, "metrics.jsonl"))[0]]
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0], losses
    assert full.final_val_loss < 0.8 * np.log(256)
    split = [r["loss"] for r in read_metrics(os.path.join(second.run_dir, "metrics.jsonl"))[0]]
    np.testing.assert_allclose(split, losses, rtol=1e-6, atol=0)
    for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(second.state.params)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)

    # a checkpoint of this run loads as a Llama model
    from lwm_jax.interop import load_pretrained
    model, cfg = load_pretrained(second.run_dir)
    assert isinstance(model, Llama) and cfg == split_cfg.model.resolved()

    # the run dir refuses a config of another family
    saved = os.path.join(second.run_dir, "config.yaml")
    with open(saved) as f:
        assert yaml.safe_load(f)["arch"] == "llama"
    with pytest.raises(ValueError, match="holds checkpoints of a run with arch='llama'"):
        _check_same_model(saved, load_config(None, [f"run_dir={second.run_dir}"]))
