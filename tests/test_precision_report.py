"""`lwm-jax precision-report` and `lwm_jax.diagnostics.precision_report`.

The planted-decay test replaces TimeMix's decay island where TimeMix looks it up, as
tests/test_fp32_islands.py does, by the same formula in the compute dtype: the report must name
the decay, and must not name it (nor any op) as below contract with the island in place.
"""
from __future__ import annotations

import importlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax import ModelConfig
from lwm_jax.cli import main
from lwm_jax.diagnostics.precision_report import EXCESS_LIMIT, format_table, precision_report
from lwm_jax.models.llama import Llama
from lwm_jax.models.llama.config import LlamaConfig
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.models.rwkv7.testing import randomize_params
from lwm_jax.models.rwkv7.time_mix import DECAY_SCALE
from lwm_jax.runtime import Runtime

time_mix_module = importlib.import_module("lwm_jax.models.rwkv7.time_mix")
CFG = ModelConfig(vocab_size=97, n_layer=2, n_embd=32, head_size=16)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 49))


@pytest.fixture(scope="module")
def rwkv():
    """A small RWKV-7 whose every parameter matters (the official init zeroes the outputs)."""
    model = RWKV7(CFG, "fp32", runtime=Runtime(wkv_impl="recurrent"), rngs=nnx.Rngs(0))
    return randomize_params(model, seed=1, scale=0.5)


def _decay_in_compute_dtype(p, x_w_BTC, policy):
    """`decay_log` without the island: LoRA through compute-dtype matmuls, w0 and the sigmoid
    in the compute dtype."""
    hidden = jnp.tanh(policy.einsum("btc,cr->btr", x_w_BTC, p["w1"]))
    d = p["w0"].astype(policy.compute_dtype) + policy.einsum("btr,rc->btc", hidden, p["w2"])
    return (-DECAY_SCALE * jax.nn.sigmoid(d)).astype(jnp.float32)


def _rows(report, name):
    return [r for r in report.rows if r.subop == name]


def test_planted_bf16_decay_is_named_the_worst_offender(monkeypatch, rwkv):
    clean = precision_report(rwkv, TOKENS, "bf16-mixed", shadow=None)
    assert clean.worst.kind == "policy"                  # the islands hold their contract
    assert max(r.excess for r in clean.rows) < EXCESS_LIMIT
    assert all(1e-4 < r.local_rel < 1e-2 for r in _rows(clean, "wkv") + _rows(clean, "ffn"))
    assert "fp32-fast" in clean.worst.suggestion

    monkeypatch.setattr(time_mix_module, "decay_log", _decay_in_compute_dtype)
    planted = precision_report(rwkv, TOKENS, "bf16-mixed", shadow=None)
    worst = planted.worst
    assert (worst.subop, worst.kind) == ("decay", "contract"), worst
    assert worst.excess >= EXCESS_LIMIT and "decay fp32 island" in worst.suggestion
    assert planted.grads == () and all(r.e2e_rel is None for r in planted.rows)
    for bad, good in zip(_rows(planted, "decay"), _rows(clean, "decay")):
        assert bad.local_rel > 5 * good.local_rel     # every layer's decay, not one


def test_clean_fp32_policy_has_float32_level_errors(rwkv):
    report = precision_report(rwkv, TOKENS, "fp32", shadow=None)
    names = {r.subop for r in report.rows}
    assert names == {"decay", "wkv", "wkv_state", "ln_x", "ffn", "logits", "loss"}
    assert len(report.rows) == 5 * CFG.n_layer + 2
    assert all(r.local_rel < 1e-5 and r.nonfinite == 0 for r in report.rows), report.rows
    assert all(r.local_rel > 0 for r in _rows(report, "wkv") + _rows(report, "ffn"))
    assert report.worst.kind == "policy" and "no change needed" in report.worst.suggestion


def test_rwkv7_gradient_groups():
    from lwm_jax.diagnostics.subops_rwkv7 import grad_group
    assert [grad_group(p) for p in [("blocks", "att", "w1"), ("blocks", "att", "key"),
                                    ("blocks", "att", "ln_x", "weight"), ("blocks", "ffn", "key"),
                                    ("blocks", "ln1", "bias"), ("ln_out", "weight"), ("emb",)]
            ] == ["decay", "att_proj", "ln_x", "ffn", "norms", "head", "emb"]


def test_llama_sub_ops_are_measured():
    cfg = LlamaConfig(vocab_size=97, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, head_dim=8,
                      ffn_hidden=64, max_seq_len=4096)
    model = Llama(cfg, "fp32", rngs=nnx.Rngs(0))
    report = precision_report(model, TOKENS, "bf16-mixed")
    per_layer = {r.subop for r in report.rows if r.layer is not None}
    assert per_layer == {"attention", "rmsnorm", "mlp"}
    assert [r.subop for r in report.rows if r.layer is None] == ["rope", "logits", "loss"]
    for r in report.rows:
        assert r.excess < EXCESS_LIMIT, r
    for r in _rows(report, "attention") + _rows(report, "mlp") + _rows(report, "rmsnorm"):
        assert 1e-4 < r.local_rel < 2e-2                   # bf16 storage, nothing worse
    rope, = _rows(report, "rope")
    assert rope.local_rel < 1e-6 and rope.e2e_rel is None  # float32 table, measured alone
    for r in report.rows:                                   # against the fp32 shadow
        assert (r.e2e_rel is None) == (r.subop in ("rope", "rmsnorm"))
    assert 1e-4 < _rows(report, "logits")[0].e2e_rel < 5e-2
    groups = {(g.layer, g.group) for g in report.grads}
    assert groups == {(None, "embed"), (None, "head")} | {
        (layer, name) for layer in (0, 1) for name in ("attention", "mlp", "norms")}
    assert all(1e-4 < g.rel < 5e-2 and g.nonfinite == 0 for g in report.grads), report.grads


def test_cli_report_on_the_tiny_config(tmp_path, capsys):
    out = tmp_path / "report"
    status = main(["precision-report", "--policy", "bf16-mixed", "--seq-len", "16",
                   "--batch-size", "1", "--shadow", "none", "--output", str(out)])
    assert status == 0
    text = capsys.readouterr().out
    assert "worst offender" in text and "suggestion:" in text
    doc = json.loads((out / "report.json").read_text())
    assert doc["policy"] == "bf16-mixed" and doc["shadow"] == "none" and doc["grads"] == []
    assert doc["batch"]["seq_len"] == 16 and doc["batch"]["data"].startswith("corpus")
    assert len([r for r in doc["rows"] if r["layer"] is not None]) == 4 * 5     # tiny: L = 4
    assert all(math.isfinite(r["local_rel"]) for r in doc["rows"])
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,needle", [
    (["--seq-len", "0"], "--seq-len"),
    (["--batch-size", "512", "--seq-len", "512"], "--batch-size x --seq-len"),
    (["--checkpoint", "nowhere", "model.n_layer=2"], "overrides apply to --config"),
    (["model.n_layr=2"], "model.n_layr"),
    (["--shadow", "fp64"], "--shadow: precision: unknown preset 'fp64'"),
    (["--data", "corpus", "model.vocab_size=300", "model.n_layer=1", "model.n_embd=64"],
     "--data corpus"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, needle):
    status = main(["precision-report", "--output", str(tmp_path / "r"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and needle in err[0], err


def test_round_mantissa_keeps_the_asked_bits():
    from lwm_jax.diagnostics.subops import round_mantissa
    x = np.array([1.0 + 2.0**-10, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -3.0 - 2.0**-12, 0.0])
    got = round_mantissa(x, 10)                     # TF32: 10 explicit bits
    assert got.tolist() == [1.0 + 2.0**-10, 1.0, 1.0 + 2.0**-9, -3.0, 0.0]  # ties to even
    bf16 = np.asarray(jnp.asarray(x[:4], jnp.float32).astype(jnp.bfloat16), np.float64)
    assert np.array_equal(round_mantissa(x[:4], 7), bf16)


def test_gpu_floors_model_tf32_products(rwkv):
    """On a GPU, float32 products at `default` / `high` run as TF32: the floors must include
    that rounding (else every fp32 island reads as a broken contract there), and only there."""
    cpu = precision_report(rwkv, TOKENS, "fp32-fast", shadow=None, platform="cpu")
    gpu = precision_report(rwkv, TOKENS, "fp32-fast", shadow=None, platform="gpu")
    exact = precision_report(rwkv, TOKENS, "fp32", shadow=None, platform="gpu")
    for name in ("logits", "wkv", "wkv_state", "ffn", "decay"):
        for c, g, e in zip(_rows(cpu, name), _rows(gpu, name), _rows(exact, name)):
            assert c.floor_rel < 1e-6 and e.floor_rel < 1e-6, (c, e)   # IEEE products
            if name == "decay":          # the decay island's products are IEEE under every policy
                assert g.floor_rel < 1e-6, g
            else:
                assert g.floor_rel > 2e-5, g                            # TF32 operands
            assert g.local_rel == c.local_rel                           # same CPU values
    assert "on gpu" in format_table(gpu) and gpu.platform == "gpu"
    mixed = precision_report(rwkv, TOKENS, "bf16-mixed", shadow=None, platform="gpu")
    for g in _rows(mixed, "wkv_state"):      # bf16 inputs, yet the kernel's in-chunk
        assert g.floor_rel > 1e-4, g           # operands (decayed keys, ...) round to TF32
    assert "TF32 products" in gpu.worst.suggestion and "fp32" in gpu.worst.suggestion


def test_cli_report_ignores_the_configs_data_files(tmp_path, capsys):
    """The report builds the model only: a config naming training data that is not on this
    machine (e.g. configs/rwkv7-0.1b.yaml's data/minipile) still reports."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {n_layer: 1, n_embd: 64}\ndata: {path: nowhere/minipile}\n")
    status = main(["precision-report", "-c", str(cfg), "--seq-len", "8", "--batch-size", "1",
                   "--shadow", "none", "--output", str(tmp_path / "r")])
    assert status == 0, capsys.readouterr().err
    with pytest.raises(ValueError, match="data.path: nowhere/minipile.bin not found"):
        from lwm_jax.train.config import load_config
        load_config(str(cfg))                        # training still refuses it


def test_rounded_operand_products_model_tf32():
    """`RoundedOperands(23)` is IEEE float32; `RoundedOperands(10)` (TF32) costs the chunked
    WKV ~1e-4 of accuracy against the float64 recurrence."""
    from lwm_jax.ops.wkv7.chunk_math import RoundedOperands
    from lwm_jax.ops.wkv7.chunked import wkv7_chunked
    from lwm_jax.ops.wkv7.reference import wkv7_reference_np
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs
    xs = random_wkv7_inputs(3, 1, 64, 2, 16, 16)
    ref, _ = wkv7_reference_np(*xs)
    err = {}
    for name, prec in (("highest", "highest"), ("f32", RoundedOperands(23)),
                       ("tf32", RoundedOperands(10))):
        o, _ = wkv7_chunked(*xs, None, None, chunk_size=32, output_dtype=jnp.float32,
                            precision=prec)
        err[name] = np.linalg.norm(np.asarray(o, np.float64) - ref) / np.linalg.norm(ref)
    assert err["f32"] == err["highest"] < 1e-6, err
    assert 3e-5 < err["tf32"] < 3e-3, err
