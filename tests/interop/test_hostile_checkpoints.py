"""Hostile checkpoint contents found by `tools/hostile_inputs.py`: each is a one-line ValueError
naming the file / tensor / field, never a traceback (IndexError, unpacking) or a silent
conversion."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lwm_jax.interop import detect_format, hf, read_params, rwkv_pth
from lwm_jax.interop.native import save_native
from lwm_jax.interop.run_ckpt import complete_steps
from lwm_jax.interop.testing import random_params
from lwm_jax.models.rwkv7.config import ModelConfig

CFG = ModelConfig(vocab_size=32, n_layer=1, n_embd=64, head_size=32, decay_lora=8, a_lora=8,
                  v_lora=8, gate_lora=8).resolved()


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=0)


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def _hf_dir(tree, tmp_path, edit=None):
    root = tmp_path / "hf"
    hf.write_hf(CFG, tree, root)
    if edit:
        sd = load_file(str(root / hf.SINGLE))
        edit(sd)
        save_file(sd, str(root / hf.SINGLE))
    return root


@pytest.mark.parametrize("name, value, message", [
    ("model.layers.0.ffn.key.weight", np.array(1, np.float32),
     "tensor 'model.layers.0.ffn.key.weight' has shape (), expected 2 dimensions"),
    ("model.embeddings.weight", np.ones(64, np.float32),
     "tensor 'model.embeddings.weight' has shape (64,), expected 2 dimensions"),
    ("model.layers.0.attn.r_k", np.ones((2, 32, 1), np.float32),
     "tensor 'model.layers.0.attn.r_k' has shape (2, 32, 1), expected 2 dimensions"),
    ("model.embeddings.weight", np.ones((32, 64), np.int32),
     "tensor 'model.embeddings.weight' has dtype int32; weights must be floating point"),
    ("model.norm.weight", np.ones(64, bool),
     "tensor 'model.norm.weight' has dtype bool; weights must be floating point"),
])
def test_hf_wrong_rank_or_integer_tensor_is_one_line(tree, tmp_path, name, value, message):
    root = _hf_dir(tree, tmp_path, lambda sd: sd.update({name: value}))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        read_params(root)
    assert str(root) in _one_line(err)


def _llama_dir(tmp_path, config=None, edit=None):
    root = tmp_path / "llama"
    root.mkdir()
    r = np.random.default_rng(0)
    shapes = {"embed_tokens": (32, 64), "norm": (64,), "layers.0.input_layernorm": (64,),
              "layers.0.post_attention_layernorm": (64,), "layers.0.self_attn.q_proj": (64, 64),
              "layers.0.self_attn.k_proj": (32, 64), "layers.0.self_attn.v_proj": (32, 64),
              "layers.0.self_attn.o_proj": (64, 64), "layers.0.mlp.gate_proj": (96, 64),
              "layers.0.mlp.up_proj": (96, 64), "layers.0.mlp.down_proj": (64, 96)}
    sd = {f"model.{k}.weight": (r.standard_normal(v) * 0.05).astype(np.float32)
          for k, v in shapes.items()}
    if edit:
        edit(sd)
    save_file(sd, str(root / "model.safetensors"))
    doc = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
           "tie_word_embeddings": True, **(config or {})}
    (root / "config.json").write_text(json.dumps(doc))
    return root


def test_llama_fixture_reads(tmp_path):
    cfg, _ = read_params(_llama_dir(tmp_path))
    assert cfg.n_head == 4 and cfg.n_kv_head == 2


@pytest.mark.parametrize("name, value, message", [
    ("model.layers.0.self_attn.q_proj.weight", np.array(1, np.float32),
     r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(\), expected 2 dimensions"),
    ("model.norm.weight", np.ones(64, np.int64),
     "tensor 'model.norm.weight' has dtype int64; weights must be floating point"),
])
def test_llama_wrong_rank_or_integer_tensor_is_one_line(tmp_path, name, value, message):
    root = _llama_dir(tmp_path, edit=lambda sd: sd.update({name: value}))
    with pytest.raises(ValueError, match=message) as err:
        read_params(root)
    assert str(root) in _one_line(err)


@pytest.mark.parametrize("config, message", [
    ({"rms_norm_eps": -1.0}, r"field 'rms_norm_eps' must be a number > 0.0, got -1.0"),
    ({"rope_theta": -5.0}, r"field 'rope_theta' must be a number > 1.0, got -5.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}},
     r"field 'rope_parameters.rope_theta' must be a number > 1.0, got -5.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
     r"field 'rope_scaling.factor' must be a number > 0.0, got -2.0"),
    ({"max_position_embeddings": 0}, r"field 'max_position_embeddings' must be .*got 0"),
])
def test_llama_config_errors_name_the_hf_field(tmp_path, config, message):
    root = _llama_dir(tmp_path, config=config)
    with pytest.raises(ValueError, match=message) as err:
        read_params(root)
    text = _one_line(err)
    assert text.startswith(f"'{root / 'config.json'}': ") and "model." not in text


def test_pth_wrong_rank_or_integer_tensor_is_one_line(tree, tmp_path):
    torch = pytest.importorskip("torch")
    sd = {k: torch.from_numpy(np.ascontiguousarray(v))
          for k, v in rwkv_pth.write_official(CFG, tree).items()}
    for name, value, message in [
            ("emb.weight", torch.zeros(3), r"tensor 'emb.weight' has shape \(3,\), expected 2"),
            ("blocks.0.ffn.key.weight", torch.tensor(1.0),
             r"tensor 'blocks.0.ffn.key.weight' has shape \(\), expected 2"),
            ("ln_out.weight", sd["ln_out.weight"].long(),
             "tensor 'ln_out.weight' has dtype int64; weights must be floating point")]:
        file = tmp_path / "m.pth"
        torch.save({**sd, name: value}, file)
        with pytest.raises(ValueError, match=message) as err:
            read_params(file)
        assert str(file) in _one_line(err)


def test_native_config_yaml_disagreeing_with_params_names_the_checkpoint(tree, tmp_path):
    root = save_native(CFG, tree, tmp_path / "m")
    file = root / "config.yaml"
    file.write_text(file.read_text().replace("n_layer: 1", "n_layer: 2"))
    with pytest.raises(ValueError, match=r"has shape \(1, .*expected \(2, ") as err:
        read_params(root)
    text = _one_line(err)
    assert str(root) in text and "config.yaml" in text


def test_step_directory_with_a_non_ascii_digit_is_ignored(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for name in ("3", "²", "٣"):                   # str.isdigit() is True for all three
        (root / name / "state").mkdir(parents=True)
        (root / name / "state" / "_METADATA").write_text("{}")
    assert complete_steps(tmp_path / "run") == [3]


@pytest.mark.parametrize("name", ["config.json", "config.yaml"])
def test_fifo_config_is_not_a_regular_file_not_missing(tmp_path, name):
    root = tmp_path / "m"
    root.mkdir()
    os.mkfifo(root / name)
    with pytest.raises(ValueError, match="not a regular file") as err:
        detect_format(root)
    assert name in _one_line(err)


def test_fifo_config_json_with_forced_format(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    os.mkfifo(root / "config.json")
    with pytest.raises(ValueError, match="config.json': not a regular file"):
        read_params(root, format="hf")


def test_fifo_run_config_yaml(tmp_path):
    from lwm_jax.interop.run_ckpt import read_run_params
    root = tmp_path / "run"
    root.mkdir()
    os.mkfifo(root / "config.yaml")
    with pytest.raises(ValueError, match="config.yaml': not a regular file"):
        read_run_params(root)
