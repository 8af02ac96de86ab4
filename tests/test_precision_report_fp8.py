"""`lwm-jax precision-report --policy fp8-mixed` and `precision_report(..., "fp8-mixed")`.

A GEMM meant to be FP8 that is not is planted by calling TimeMix with one of its FP8 metas
removed from its parameter dict (it then runs as a bf16 `Policy.einsum`): the report must
name that site in every layer. A lost scale is planted through the starting metas: an input
history whose amax (1e6) puts the receptance's scale at 2^12, so its inputs (|x| < 8) flush
to zero in e4m3. The LLaMA tests plant theirs the same way through `attention_forward` /
`mlp_forward`.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from lwm_jax import ModelConfig
from lwm_jax.cli import main
from lwm_jax.diagnostics.precision_fp8 import FORMAT_MAX
from lwm_jax.diagnostics.precision_report import EXCESS_LIMIT, format_table, precision_report
from lwm_jax.diagnostics.subops import pow2_scale
from lwm_jax.models.llama import Llama
from lwm_jax.models.llama import block as llama_block
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.models.rwkv7 import block as block_module
from lwm_jax.models.rwkv7.testing import randomize_params
from lwm_jax.precision.fp8 import Fp8Meta, init_meta
from lwm_jax.runtime import Runtime
from lwm_jax.train.config import load_config

CFG = ModelConfig(vocab_size=97, n_layer=2, n_embd=64, head_size=16)
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 17))
SITES = ("att/receptance", "att/key", "att/value", "att/output", "ffn/key", "ffn/value")
GEMM_OPS = ("att_r", "att_k", "att_v", "att_o", "ffn_k", "ffn_v")
STEPS = 3
LLAMA_OVERRIDES = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.n_kv_head=1",
                   "model.head_dim=32", "model.ffn_hidden=128"]
LLAMA_SITES = ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down")
LLAMA_OPS = ("attn_q", "attn_k", "attn_v", "attn_o", "mlp_gate", "mlp_up", "mlp_down")
LLAMA_TOKENS = np.random.default_rng(2).integers(0, 256, (2, 17))


@pytest.fixture(scope="module")
def rwkv():
    model = RWKV7(CFG, "fp32", runtime=Runtime(wkv_impl="recurrent"), rngs=nnx.Rngs(0))
    return randomize_params(model, seed=1, scale=0.5)


@pytest.fixture(scope="module")
def report(rwkv):
    """fp8-mixed against the fp32 shadow, metas calibrated over STEPS steps of the batch."""
    return precision_report(rwkv, TOKENS, "fp8-mixed", fp8_calibration_steps=STEPS)


@pytest.fixture(scope="module")
def llama():
    cfg = load_config("configs/llama-tiny.yaml", LLAMA_OVERRIDES).model
    return Llama(cfg, "fp32", rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def llama_report(llama):
    return precision_report(llama, LLAMA_TOKENS, "fp8-mixed", fp8_calibration_steps=STEPS)


def _rows(report, name):
    return [r for r in report.rows if r.subop == name]


def test_every_fp8_gemm_is_measured_at_its_e4m3_floor(report):
    names = {r.subop for r in report.rows if r.layer is not None}
    assert names == {"decay", "wkv", "wkv_state", "ln_x", "ffn", *GEMM_OPS}
    for name in GEMM_OPS:
        for r in _rows(report, name):
            assert 1e-2 < r.local_rel < 1e-1, r          # e4m3's 3 mantissa bits
            assert 0.8 < r.excess < 1.25 and r.e2e_rel is not None, r
    sec = report.fp8
    assert sec.sites == SITES and sec.not_fp8 == ()
    assert sec.float8_dots == sec.expected_float8_dots == 6 * CFG.n_layer
    assert len(sec.gemms) == 6 * CFG.n_layer
    for g in sec.gemms:       # bf16 operands: far below (past layer 0 the value's gate
        assert g.fp8 and g.compute_floor_rel < g.fp8_floor_rel / 4, g   # mixes in layer 0's)
    assert report.worst.kind == "policy" and "e4m3" in report.worst.suggestion
    assert {g.group for g in report.grads if g.layer == 0} >= {"att_proj", "ffn"}
    assert all(g.nonfinite == 0 and g.rel < 1 for g in report.grads), report.grads
    text = format_table(report)
    assert "FP8 GEMMs: metas: fresh FP8 metas" in text and "every GEMM meant to be FP8" in text
    assert sum(line.startswith(SITES) for line in text.splitlines()) == len(SITES)
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["fp8"]["calibration_steps"] == STEPS and doc["fp8"]["not_fp8"] == []


@pytest.mark.parametrize("which", ["rwkv7", "llama"])
def test_trajectories_follow_delayed_scaling(request, which):
    """Step 1 quantizes at the fresh scale 1; every later step (and the measured batch) with
    the power of two at or above (largest earlier amax) / (format max), per site, layer and
    row; every GEMM records an amax at every step."""
    report, sites, n_layer = ((request.getfixturevalue("report"), SITES, CFG.n_layer)
                              if which == "rwkv7" else
                              (request.getfixturevalue("llama_report"), LLAMA_SITES, 2))
    sec = report.fp8
    assert sec.meta_source.startswith("fresh FP8 metas") and sec.skipped_steps == 0
    assert sec.calibration_data == "the report's batch at every step" and sec.history == 1024
    assert sec.sites == sites
    for site in sites:
        scale, amax = np.asarray(sec.scale[site]), np.asarray(sec.amax[site])
        measured = np.asarray(sec.measured_scale[site])
        assert scale.shape == amax.shape == (STEPS, n_layer, 3), site
        assert measured.shape == np.asarray(sec.measured_amax[site]).shape == (n_layer, 3)
        assert np.all(scale[0] == 1.0) and np.all(amax > 0), site
        for step in range(1, STEPS + 1):
            seen = amax[:step].max(axis=0)
            want = [[pow2_scale(seen[l, r], FORMAT_MAX[r]) for r in range(3)]
                    for l in range(n_layer)]
            got = scale[step] if step < STEPS else measured
            np.testing.assert_array_equal(got, want, err_msg=f"{site} step {step}")
            assert np.all(np.log2(got) == np.round(np.log2(got)))     # powers of two
            assert np.all(got >= seen / np.asarray(FORMAT_MAX))


def _assert_only_site_flagged(planted, site, n_layer):
    """Exactly `site` is flagged not-FP8, in every layer, for an unread meta at the bf16
    floor; its GEMM rows sit at the compute-dtype floor, far below e4m3's, the others are FP8."""
    flagged = [n for n in planted.fp8.not_fp8 if n.layer is not None]
    assert [(n.site, n.layer) for n in flagged] == [(site, l) for l in range(n_layer)]
    for n in flagged:
        assert "meta came back all zeros" in n.why and "bfloat16 floor" in n.why, n
    for g in planted.fp8.gemms:
        assert g.fp8 == (g.site != site), g
        if g.site == site:
            assert g.local_rel < 2 * g.compute_floor_rel and g.local_rel < g.fp8_floor_rel / 4


@pytest.mark.parametrize("meta,op", [("fp8_key", "att_k"), ("fp8_value", "att_v")])
def test_a_gemm_meant_to_be_fp8_that_is_not_is_flagged(monkeypatch, rwkv, meta, op):
    """Both signals name the site in every layer: its meta came back unused, and its error
    sits at the bf16 floor (~20x below e4m3's; past layer 0 the value's gate dilutes it, the
    two floors still apart); the traced forward holds one float8 product fewer per layer."""
    forward = block_module.time_mix_forward

    def without_meta(p, *args, **kwargs):
        return forward({k: v for k, v in p.items() if k != meta}, *args, **kwargs)
    monkeypatch.setattr(block_module, "time_mix_forward", without_meta)
    planted = precision_report(rwkv, TOKENS, "fp8-mixed", shadow=None, fp8_calibration_steps=1)
    site = f"att/{meta[4:]}"
    _assert_only_site_flagged(planted, site, CFG.n_layer)
    assert planted.fp8.float8_dots == 5 * CFG.n_layer
    assert planted.worst.kind == "not_fp8" and (planted.worst.subop, planted.worst.layer) == (
        op, 0)
    assert f"{site} layer 0 did not run as an FP8 GEMM" in planted.worst.suggestion
    assert f"NOT FP8: {site} layer 1" in format_table(planted)


def test_a_lost_scale_is_far_above_the_floor(rwkv, report):
    """Metas given are used as they are (no calibration by default). Given the amaxes the
    calibrated report measured, except a receptance input history of 1e6 (scale 2^12, its
    inputs flush to zero): every layer's `att_r` is named, far above its floor, while layer
    0's key and value GEMMs (inputs not downstream of r) stay at theirs."""
    abstract = nnx.eval_shape(lambda: RWKV7(CFG, "fp8-mixed", rngs=nnx.Rngs(0)))
    metas = jax.tree.map(lambda a: np.array(init_meta(history=4, stack=a.shape[:-2])),
                         nnx.to_pure_dict(nnx.state(abstract, Fp8Meta)))
    for mixer, names in metas["blocks"].items():
        for name, meta in names.items():
            meta[:, :, 1] = report.fp8.measured_amax[f"{mixer}/{name[4:]}"]
    metas["blocks"]["att"]["fp8_receptance"][:, 0, 1] = 1e6
    lost = precision_report(rwkv, TOKENS, "fp8-mixed", shadow=None, fp8_metas=metas,
                            fp8_source="planted metas")
    assert lost.fp8.meta_source == "planted metas" and lost.fp8.calibration_steps == 0
    assert np.all(np.asarray(lost.fp8.measured_scale["att/receptance"])[:, 0] == 2.0**12)
    for r in _rows(lost, "att_r"):
        assert r.local_rel > 0.9 and r.excess > EXCESS_LIMIT, r
    for name in ("att_k", "att_v"):
        assert _rows(lost, name)[0].excess < 1.25, _rows(lost, name)
    assert (lost.worst.kind, lost.worst.subop) == ("contract", "att_r")
    assert "delayed scale is stale or lost" in lost.worst.suggestion


def test_refusals_are_one_line(rwkv, llama):
    cases = [(rwkv, "fp8-mixed", {"shadow": "fp8-mixed"}, "reference must compute"),
             (llama, "fp8-mixed", {"fp8_calibration_steps": 1.5}, "must be an integer >= 0"),
             (rwkv, "fp8-mixed", {"fp8_calibration_steps": -1}, "must be an integer >= 0"),
             (rwkv, "bf16-mixed", {"fp8_calibration_steps": 2}, "apply to an FP8 policy"),
             (rwkv, "fp8-mixed", {"fp8_calibration_tokens": TOKENS}, "[N, B, T + 1]"),
             (rwkv, "fp8-mixed", {"fp8_metas": {"blocks": {}}}, "no meta for site att/key")]
    for model, policy, kw, needle in cases:
        with pytest.raises(ValueError) as err:
            precision_report(model, TOKENS, policy, **kw)
        assert needle in str(err.value) and "\n" not in str(err.value), (kw, err.value)


def test_cli_fp8_report_on_a_tiny_config(tmp_path, capsys):
    out = tmp_path / "report"
    status = main(["precision-report", "--policy", "fp8-mixed", "model.n_layer=1",
                   "--seq-len", "16", "--batch-size", "1", "--shadow", "none",
                   "--fp8-calibration-steps", "2", "--output", str(out)])
    assert status == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "FP8 GEMMs: metas: fresh FP8 metas" in text and "2 calibration steps" in text
    doc = json.loads((out / "report.json").read_text())
    assert doc["policy"] == "fp8-mixed" and doc["batch"]["fp8_calibration"].endswith("seeds 1..2")
    fp8 = doc["fp8"]
    assert fp8["sites"] == list(SITES) and fp8["not_fp8"] == []
    assert np.asarray(fp8["scale"]["ffn/key"]).shape == (2, 1, 3)
    assert {r["subop"] for r in doc["rows"]} >= set(GEMM_OPS)
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reads_a_training_runs_fp8_scales(tmp_path, capsys):
    """A run trained under fp8-mixed is studied with its saved scales (no calibration). Two
    steps in, its zero-initialised kernels (time-mix output, channel-mix value) grew ~100x in
    the last step, past the range their history allows: the report says they were clipped."""
    from lwm_jax.train.config import load_config
    from lwm_jax.train.trainer import train
    run_dir = tmp_path / "run"
    result = train(load_config(None, [
        "model.n_layer=2", "model.n_embd=64", "train.ctx_len=16", "train.batch_size=2",
        "train.eval_every=0", "train.warmup_steps=1", "train.steps=2", "checkpoint.every=2",
        "precision=fp8-mixed", f"run_dir={run_dir}"]), progress=False)
    saved = jax.device_get(result.state.fp8)
    capsys.readouterr()
    out = tmp_path / "report"
    status = main(["precision-report", "--checkpoint", str(run_dir), "--policy", "fp8-mixed",
                   "--seq-len", "16", "--batch-size", "1", "--shadow", "none",
                   "--no-gradients", "--output", str(out)])
    assert status == 0, capsys.readouterr().err
    fp8 = json.loads((out / "report.json").read_text())["fp8"]
    assert fp8["meta_source"] == f"checkpoint {run_dir} step 2 (the run's saved FP8 scales)"
    assert fp8["calibration_steps"] == 0 and fp8["scale"]["att/key"] == []
    for mixer, name in (("att", "key"), ("ffn", "key")):     # inputs: the saved history's
        history = saved["blocks"][mixer][f"fp8_{name}"][:, 0, 1:].max(axis=-1)
        want = [pow2_scale(a) for a in history]
        assert [s[0] for s in fp8["measured_scale"][f"{mixer}/{name}"]] == want
    clipped = {(c["site"], c["row"]) for c in fp8["clipped"]}
    assert {("att/output", "kernel"), ("ffn/value", "kernel")} <= clipped
    assert "clipped: att/output layer 0 kernel" in capsys.readouterr().out


# ------------------------------------------------------------------------------ LLaMA
def test_every_llama_fp8_gemm_is_measured_at_its_e4m3_floor(llama_report):
    """One row per FP8 GEMM site and layer, on its input as the policy formed it (the block's
    taps), at its e4m3 floor; the attention and MLP sub-ops' floors take e4m3 operands too."""
    report = llama_report
    names = [r.subop for r in report.rows if r.layer == 0]
    assert names == ["attn_q", "attn_k", "attn_v", "attn_o", "attention", "rmsnorm",
                     "mlp_gate", "mlp_up", "mlp_down", "mlp"]
    for name in LLAMA_OPS:
        rows = _rows(report, name)
        assert [r.layer for r in rows] == [0, 1], name
        for r in rows:
            assert 1e-2 < r.local_rel < 1e-1, r          # e4m3's 3 mantissa bits
            assert 0.8 < r.excess < 1.25 and r.e2e_rel is not None, r
    for name in ("attention", "mlp"):
        for r in _rows(report, name):
            assert 1e-2 < r.local_rel < 2e-1 and r.excess < 1.25, r
    sec = report.fp8
    assert sec.sites == LLAMA_SITES and sec.not_fp8 == () and sec.clipped == ()
    assert sec.float8_dots == sec.expected_float8_dots == 7 * 2
    assert [(g.site, g.layer) for g in sec.gemms] == [(s, l) for s in LLAMA_SITES
                                                       for l in (0, 1)]
    for g in sec.gemms:                                  # bf16 operands: far below
        assert g.fp8 and g.compute_floor_rel < g.fp8_floor_rel / 4, g
    assert report.worst.kind == "policy" and "e4m3" in report.worst.suggestion
    text = format_table(report)
    assert "every GEMM meant to be FP8" in text
    assert sum(line.startswith(LLAMA_SITES) for line in text.splitlines()) == len(LLAMA_SITES)
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["fp8"]["sites"] == list(LLAMA_SITES) and doc["fp8"]["not_fp8"] == []


@pytest.mark.parametrize("forward,meta,op", [("attention_forward", "fp8_v", "attn_v"),
                                             ("mlp_forward", "fp8_down", "mlp_down")])
def test_a_llama_gemm_that_is_not_fp8_is_flagged(monkeypatch, llama, forward, meta, op):
    """A LLaMA projection called without its meta runs as a bf16 `Policy.einsum`: its meta
    comes back unused and its error sits at its bf16 floor, in every layer."""
    original = getattr(llama_block, forward)

    def without_meta(p, *args, **kwargs):
        return original({k: v for k, v in p.items() if k != meta}, *args, **kwargs)
    monkeypatch.setattr(llama_block, forward, without_meta)
    planted = precision_report(llama, LLAMA_TOKENS, "fp8-mixed", shadow=None,
                               fp8_calibration_steps=1)
    site = dict((o, s) for s, o in zip(LLAMA_SITES, LLAMA_OPS))[op]
    _assert_only_site_flagged(planted, site, 2)
    assert planted.fp8.float8_dots == 6 * 2
    assert (planted.worst.kind, planted.worst.subop, planted.worst.layer) == ("not_fp8", op, 0)
    assert f"{site} layer 0 did not run as an FP8 GEMM" in planted.worst.suggestion
    assert f"NOT FP8: {site} layer 1" in format_table(planted)
