"""Hugging Face LLaMA import: a random `transformers.LlamaForCausalLM`, saved with
`save_pretrained`, loads through `load_pretrained` with the same float32 logits."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lwm_jax.interop import convert, load_pretrained  # noqa: E402
from lwm_jax.models.llama import Llama, RopeScaling  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
T = 40          # longer than the llama3 variant's 16-position original context


def _save_hf(path, seed=0, **overrides):
    """A small random LlamaForCausalLM (norm weights randomised too) saved to `path`; returns
    it (float32, eval mode)."""
    # rms_norm_eps and max_position_embeddings are not the importer's defaults (1e-6, 2048):
    # an importer that ignored them would still match a fixture that used those values
    kwargs = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                  rms_norm_eps=3e-3, initializer_range=0.1, tie_word_embeddings=False)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**kwargs)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return model


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _ours(model, tokens):
    graph, params = nnx.split(model)
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graph, p)(t))(params, jnp.asarray(tokens)))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("variant", [
    {},                                                                # GQA, plain RoPE
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3},
     "tie_word_embeddings": True, "num_key_value_heads": 1},          # llama3 rule, tied, MQA
    {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
     "head_dim": 32},                                                  # linear, head_dim != C/H
])
def test_logits_match_transformers(tmp_path, variant):
    hf = _save_hf(tmp_path, **variant)
    model, cfg = load_pretrained(tmp_path)
    assert isinstance(model, Llama)
    assert (cfg.n_head, cfg.n_kv_head) == (4, variant.get("num_key_value_heads", 2))
    assert cfg.tie_embeddings is variant.get("tie_word_embeddings", False)
    assert (cfg.rms_eps, cfg.max_seq_len) == (3e-3, 96)
    tokens = np.random.default_rng(0).integers(0, 101, (2, T))
    ref = _hf_logits(hf, tokens)
    assert _rel(_ours(model, tokens), ref) < 1e-4


def test_llama3_scaling_is_read_and_matters(tmp_path):
    _save_hf(tmp_path, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3})
    model, cfg = load_pretrained(tmp_path)
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert cfg.rope_theta == 500000.0
    tokens = np.random.default_rng(1).integers(0, 101, (1, T))
    import dataclasses
    plain = nnx.eval_shape(lambda: Llama(dataclasses.replace(cfg, rope_scaling=None), "fp32",
                                         rngs=nnx.Rngs(0)))
    nnx.update(plain, nnx.state(model, nnx.Param))
    assert _rel(_ours(plain, tokens), _ours(model, tokens)) > 1e-3


def test_older_config_keys_and_convert_round_trip(tmp_path):
    """transformers 4 wrote `rope_theta` + `rope_scaling`; `lwm-jax convert` keeps the arch."""
    hf = _save_hf(tmp_path / "hf", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                    **LLAMA3})
    file = tmp_path / "hf" / "config.json"
    doc = json.loads(file.read_text())
    params = doc.pop("rope_parameters")
    doc["rope_theta"] = params.pop("rope_theta")
    doc["rope_scaling"] = params
    file.write_text(json.dumps(doc))
    convert(tmp_path / "hf", tmp_path / "ours")
    model, cfg = load_pretrained(tmp_path / "ours")
    assert isinstance(model, Llama) and cfg.rope_scaling.kind == "llama3"
    tokens = np.random.default_rng(2).integers(0, 101, (1, 12))
    assert _rel(_ours(model, tokens), _hf_logits(hf, tokens)) < 1e-4


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope type 'yarn' is not supported"),
    ({"attention_bias": True}, "attention_bias=true; biases are not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'; only silu"),
    ({"num_hidden_layers": 3}, "config.json num_hidden_layers=3 but the weights say 2"),
    # a fraction or a string where a number belongs: named, never truncated (4.5 -> 4 heads)
    ({"num_attention_heads": 4.5}, r"field 'num_attention_heads' is .* expected an integer"),
    ({"rms_norm_eps": "1e-5"}, r"field 'rms_norm_eps' is .* expected a finite number"),
    ({"max_position_embeddings": "4k"}, r"field 'max_position_embeddings' .* an integer"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2", "rope_theta": 1e4}},
     r"config.json factor='2' is not a finite number"),
])
def test_unsupported_or_inconsistent_checkpoints_are_one_line(tmp_path, change, message):
    _save_hf(tmp_path)
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    with pytest.raises(ValueError, match=message) as err:
        load_pretrained(tmp_path)
    assert "\n" not in str(err.value)
