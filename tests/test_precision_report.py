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
    # No checkpoint: the initialisation, warmed, and every output says so. At RWKV-7's init
    # ffn.value and att.output are 0, and a fresh model's FFN rows read exactly 0 (bf16 "exact").
    source = doc["model_source"]
    assert source.startswith("warmed initialisation of the built-in tiny config (seed 0)")
    assert f"model studied: {source}" in text
    assert {"blocks/ffn/value", "blocks/att/output", "emb"} <= set(doc["warmed"])
    for r in doc["rows"]:
        if r["subop"] in ("ffn", "wkv", "ln_x"):
            assert 1e-4 < r["local_rel"] < 2e-2, r                   # bf16 storage's cost


def test_warming_gives_degenerate_parameters_trained_like_values():
    """`warm_params`: only zero / constant parameters (and RWKV-7's near-zero embedding) change,
    at their documented scales, the same for one seed; it is what makes the FFN measurable."""
    from lwm_jax.diagnostics.warm import warm_params
    fresh = lambda: RWKV7(CFG, "fp32", runtime=Runtime(wkv_impl="recurrent"),  # noqa: E731
                          rngs=nnx.Rngs(0))
    flat = lambda m: {"/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)  # noqa
                      for p, v in jax.tree_util.tree_flatten_with_path(
                          nnx.to_pure_dict(nnx.state(m, nnx.Param)))[0]}
    before = precision_report(fresh(), TOKENS, "bf16-mixed", shadow=None)
    assert all(r.local_rel == 0.0 for r in _rows(before, "ffn"))    # the misleading "exact"

    a, b, c = fresh(), fresh(), fresh()
    init = flat(a)
    warmed = warm_params(a, seed=0)
    assert warmed == warm_params(b, seed=0) and warm_params(c, seed=1) == warmed
    after, again, other = flat(a), flat(b), flat(c)
    assert set(warmed) == {"emb", "ln0/bias", "ln0/weight", "ln_out/bias", "ln_out/weight"} | {
        f"blocks/{n}" for n in ("att/a1", "att/g1", "att/k_a", "att/ln_x/bias", "att/ln_x/weight",
                                "att/output", "att/r_k", "att/v1", "att/w1", "ffn/value",
                                "ln1/bias", "ln1/weight", "ln2/bias", "ln2/weight")}
    for name, value in init.items():
        assert np.array_equal(after[name], again[name]), name          # one seed, one model
        assert (name in warmed) != np.array_equal(after[name], value), name
        if name in warmed:
            assert not np.array_equal(after[name], other[name]), name
    C, F = CFG.n_embd, CFG.resolved().ffn_dim
    assert abs(np.std(after["blocks/ffn/value"]) * math.sqrt(F) - 1) < 0.1      # N(0, 1/in)
    assert abs(np.std(after["blocks/att/output"]) * math.sqrt(C) - 1) < 0.1
    assert abs(np.std(after["emb"]) - 1) < 0.1                                   # N(0, 1)
    projections = ("att/a1", "att/g1", "att/v1", "att/w1", "att/output", "ffn/value")
    vectors = [n for n in warmed if n != "emb" and not n.endswith(projections)]
    noise = np.concatenate([(after[n] - init[n]).ravel() for n in vectors])     # N(0, 0.1²)
    assert noise.size > 500 and abs(np.std(noise) - 0.1) < 0.01 and abs(np.mean(noise)) < 0.01

    report = precision_report(a, TOKENS, "bf16-mixed", shadow=None, model_source="warmed",
                              warmed=warmed)
    assert all(1e-4 < r.local_rel < 2e-2 for r in _rows(report, "ffn")), report.rows
    assert report.to_dict()["warmed"] == list(warmed)


def test_prepare_model_names_the_model_studied():
    """The source string of each case; only a non-checkpoint model without --no-warm changes."""
    import argparse

    from lwm_jax.diagnostics.report_cli import prepare_model
    args = lambda **kw: argparse.Namespace(**{  # noqa: E731
        "checkpoint": None, "format": None, "config": None, "overrides": [], "no_warm": False,
        "seed": 3, **kw})
    model = RWKV7(CFG, "fp32", rngs=nnx.Rngs(0))
    value = np.asarray(model.blocks.ffn.value[...])
    assert prepare_model(model, args(checkpoint="runs/tiny", format="run")) == (
        "checkpoint runs/tiny (run)", ())
    assert prepare_model(model, args(checkpoint="runs/tiny"), "checkpoint runs/tiny step 7") \
        == ("checkpoint runs/tiny step 7", ())
    source, warmed = prepare_model(model, args(config="a.yaml", overrides=["model.n_layer=2"],
                                               no_warm=True))
    assert source.startswith("fresh initialisation of config a.yaml with model.n_layer=2, not "
                             "warmed") and warmed == ()
    assert np.array_equal(np.asarray(model.blocks.ffn.value[...]), value)
    source, warmed = prepare_model(model, args())
    assert source.startswith("warmed initialisation of the built-in tiny config (seed 3): "
                             f"{len(warmed)} zero- or constant-initialised parameters")
    assert "blocks/ffn/value" in warmed and np.all(np.asarray(model.blocks.ffn.value[...]) != 0)


def test_cli_studies_a_checkpoint_as_loaded(tmp_path, capsys):
    """With --checkpoint the report names it and changes nothing: a checkpoint of a fresh
    initialisation keeps its zero FFN (its rows read exactly 0), no parameter is warmed."""
    from lwm_jax.interop.api import export
    model = RWKV7(CFG, "fp32", rngs=nnx.Rngs(0))
    ckpt = str(export(model, tmp_path / "hf", format="hf", tokenizer=None))
    out = tmp_path / "report"
    status = main(["precision-report", "--checkpoint", ckpt, "--seq-len", "8", "--batch-size",
                   "1", "--shadow", "none", "--output", str(out)])
    assert status == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "report.json").read_text())
    assert doc["model_source"] == f"checkpoint {ckpt}" and doc["warmed"] == []
    assert f"model studied: checkpoint {ckpt}" in text
    assert [r["local_rel"] for r in doc["rows"] if r["subop"] == "ffn"] == [0.0] * CFG.n_layer


@pytest.mark.parametrize("argv,needle", [
    (["--seq-len", "0"], "--seq-len"),
    (["--seed", "-1"], "--seed: must be an integer in [0, 2**63), got -1"),
    (["--seed", str(2**63)], "--seed: must be an integer in [0, 2**63)"),
    (["--output", ""], "--output: empty path"),
    (["--format", "hf"], "--format hf: names a checkpoint's format"),
    (["--checkpoint", "nowhere", "--no-warm"], "--no-warm: a checkpoint is studied as loaded"),
    (["--batch-size", "512", "--seq-len", "512"], "--batch-size x --seq-len"),
    (["--checkpoint", "nowhere", "model.n_layer=2"], "overrides apply to --config"),
    (["model.n_layr=2"], "model.n_layr"),
    (["--shadow", "fp64"], "--shadow: precision: unknown preset 'fp64'"),
    (["--data", "corpus", "model.vocab_size=300", "model.n_layer=1", "model.n_embd=64"],
     "--data corpus"),
    (["--fp8-calibration-steps", "-1"], "--fp8-calibration-steps: must be >= 0, got -1"),
    (["--policy", "bf16-mixed", "--fp8-calibration-steps", "2"],
     "--fp8-calibration-steps: applies to an FP8 policy (fp8-mixed, g=fp8), not 'bf16-mixed'"),
    (["--policy", "fp8-mixed", "--shadow", "fp8-mixed"], "--shadow fp8-mixed: has FP8 GEMMs"),
    (["--policy", "fp8-mixed", "--config", "configs/rwkv7-hybrid-tiny.yaml"],
     "no sub-op table for model class RWKVHybrid"),
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
