"""`lwm-jax export --format hf` of the byte-level quickstart model writes tokenizer files that
transformers' `AutoTokenizer` (and the `tokenizers` library) load as our byte tokenizer."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lwm_jax.cli import main
from lwm_jax.interop import read_params
from lwm_jax.interop.testing import random_params
from lwm_jax.precision.loss_scale import NoLossScale
from lwm_jax.tokenizers import ByteTokenizer
from lwm_jax.train.checkpoint import Checkpointer
from lwm_jax.train.config import CheckpointSection, RunConfig
from lwm_jax.train.step import TrainState

TEXTS = ["Hello, world!", "", "  two spaces", "caf\u00e9 \u6771\u4eac \U0001F600",
         "NUL\x00inside", "<|endoftext|>", "\u0100 and \u00ff", "line\r\nbreaks\ttabs\n"]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """A run directory of the default `lwm-jax train` config (byte-level, vocab 256) with one
    checkpoint, written by the trainer's own `Checkpointer` (no training needed)."""
    run = tmp_path_factory.mktemp("quickstart")
    cfg = RunConfig(run_dir=str(run))
    assert cfg.model.vocab_size == 256 and cfg.data.tokenizer == "byte"
    (run / "config.yaml").write_text(cfg.to_yaml())
    params = jax.tree.map(jnp.asarray, random_params(cfg.model, seed=3))
    state = TrainState(jnp.int32(2), params, optax.adamw(1e-3).init(params), NoLossScale(),
                       jax.random.PRNGKey(0))
    ckpt = Checkpointer(str(run / "checkpoints"), CheckpointSection(async_=False))
    ckpt.save(2, state, {"step": 2})
    ckpt.close()
    return run


def test_cli_export_of_the_byte_model_loads_in_auto_tokenizer(quickstart_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--input", str(quickstart_run), "--output", str(out),
                 "--format", "hf"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert read_params(out)[0].vocab_size == 256                 # the weights still load
    ours = ByteTokenizer()
    tokenizers = pytest.importorskip("tokenizers")
    raw = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        assert raw.encode(text, add_special_tokens=False).ids == ours.encode(text), text
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    rng = np.random.default_rng(0)
    for text in TEXTS:
        ids = ours.encode(text)
        assert auto(text)["input_ids"] == ids, text
        assert auto.decode(ids) == text
    for ids in ([0xE6, 0x9D], [0xFF, 0x41], [int(i) for i in rng.integers(0, 256, 64)]):
        assert auto.decode(ids) == ours.decode(ids), ids       # invalid UTF-8 -> U+FFFD alike
    assert auto.eos_token_id == 0 and auto.pad_token_id == 0


def test_no_tokenizer_files_unless_asked_for_another_size(tmp_path):
    """"auto" writes tokenizer files only for the sizes it knows (256: byte, 65536: World); a
    byte-level export can also be asked for by name, and refused for a smaller model."""
    from lwm_jax.interop import export
    from lwm_jax.interop.params import model_from_params
    from lwm_jax.models.rwkv7.config import ModelConfig
    cfg = ModelConfig(vocab_size=96, n_layer=1, n_embd=64, head_size=32)
    model = model_from_params(cfg, random_params(cfg, seed=1))
    out = export(model, tmp_path / "plain", format="hf")
    assert not (out / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="has 256 ids but the model only 96"):
        export(model, tmp_path / "byte", format="hf", tokenizer="byte")
