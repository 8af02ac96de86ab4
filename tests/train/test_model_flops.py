"""Model FLOPs per token by the field's MFU convention (`lwm_jax.models.flops`): hand-checked
numbers for a tiny config of each family, the same count rebuilt independently from the
model's actual parameter tree, the `model_tflops` / `model_mfu` train-record fields and step
line, and the roofline estimate's `model_mfu` (`lwm_jax.aot.plan`)."""
import dataclasses
import math
import os
import re
import time
import types

import jax
import pytest
from flax import nnx

from lwm_jax.aot import cli as aot_cli
from lwm_jax.aot.plan import _estimate
from lwm_jax.hardware import ChipSpec
from lwm_jax.models import flops
from lwm_jax.models.hybrid.config import HybridConfig
from lwm_jax.models.llama.config import LlamaConfig
from lwm_jax.models.registry import ARCHS, arch_of_config
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.train.config import load_config
from lwm_jax.train.metrics import MetricsLogger, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 10                                     # context length of the hand-checked cases
RWKV_01B_PARAMS = 191_084_544              # configs/rwkv7-0.1b.yaml (the spec's 191.08M)
LORA = dict(decay_lora=2, a_lora=2, v_lora=2, gate_lora=2)
RWKV = ModelConfig(vocab_size=16, n_layer=2, n_embd=8, head_size=4, **LORA)
LLAMA = LlamaConfig(vocab_size=16, n_layer=2, n_embd=8, n_head=2, n_kv_head=1, head_dim=4,
                    ffn_hidden=12, max_seq_len=32)
HYBRID = HybridConfig(vocab_size=16, n_layer=3, n_embd=8, head_size=4, attention_layers=(1,),
                      attn_kv_heads=1, **LORA)

# By hand (V=16, C=8, N=4 so H=2, LoRA ranks 2, T=10):
# rwkv7:  params 2VC + 4C + L(19C + 12C² + 2C·8) = 256 + 32 + 2·1048 = 2384; less the
#         embedding 128 -> 2256; WKV 9·H·N² = 288 per layer: 6·2256 + 3·2·288 = 15264.
# llama:  params 2VC + C + L(2C + 2·C·8 + 2·C·4 + 3·C·12) = 264 + 2·496 = 1256; less 128 ->
#         1128; attention 2·T·H·D = 160 per layer: 6·1128 + 3·2·160 = 7728 (tied: the same).
# hybrid: two RWKV layers 2384 + one attention layer (4C + 2C² + 2·C·1·N + C + 2·C·4C = 744)
#         = 3128; less 128 -> 3000; 6·3000 + 3·(2·288 + 2·T·C) = 18000 + 3·736 = 20208.
BY_HAND = [("rwkv7", RWKV, 15264), ("llama", LLAMA, 7728),
           ("llama-tied", dataclasses.replace(LLAMA, tie_embeddings=True), 7728),
           ("rwkv7-hybrid", HYBRID, 20208)]


@pytest.mark.parametrize("name,cfg,expected", BY_HAND, ids=[c[0] for c in BY_HAND])
def test_tiny_configs_match_the_hand_count(name, cfg, expected):
    assert flops.model_flops_per_token(cfg, T) == expected
    assert arch_of_config(cfg).model_flops_per_token(cfg, T) == expected


def _tree_matmul_params(model, tied: bool) -> int:
    """Parameters of the model's actual tree, less the input embedding (`emb` / `embed`), plus
    the head once more when it is that embedding."""
    total, table = 0, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        size = math.prod(leaf.shape)
        total += size
        if getattr(path[0], "key", None) in ("emb", "embed"):
            table = size
    assert table, "no embedding found in the parameter tree"
    return total - table + (table if tied else 0)


def _wkv_forward(n_head: int, n: int) -> int:
    """WKV forward FLOPs per token of one layer, term by term, per head (state n x n):
    decay, a^T S, b (a^T S) and its add into S, k v^T and its add, S^T r."""
    decay, a_s, rank1, kv, read = n * n, 2 * n * n, 2 * n * n, 2 * n * n, 2 * n * n
    return n_head * (decay + a_s + rank1 + kv + read)


def _attention_forward(q_width: int, ctx_len: int) -> int:
    """QK^T and AV of one causal layer per token: 2 matmuls x 2 FLOPs x (T / 2 keys on average,
    MaxText's halving) x q_width."""
    return int(2 * 2 * (ctx_len / 2) * q_width)


def _independent_count(name: str, cfg, model, ctx_len: int = T) -> int:
    tied = bool(getattr(cfg, "tie_embeddings", False))
    weights = 6 * _tree_matmul_params(model, tied)
    if name == "rwkv7":
        mixers = cfg.n_layer * _wkv_forward(cfg.n_head, cfg.head_size)
    elif name.startswith("llama"):
        c = cfg.resolved()
        mixers = c.n_layer * _attention_forward(c.n_head * c.head_dim, ctx_len)
    else:
        n_attn = len(cfg.attention_layers)
        mixers = ((cfg.n_layer - n_attn) * _wkv_forward(cfg.n_head, cfg.head_size)
                  + n_attn * _attention_forward(cfg.n_embd, ctx_len))
    return weights + 3 * mixers


@pytest.mark.parametrize("name,cfg,expected", BY_HAND, ids=[c[0] for c in BY_HAND])
def test_count_equals_one_rebuilt_from_the_parameter_tree(name, cfg, expected):
    arch = ARCHS[name.removesuffix("-tied")]
    model = nnx.eval_shape(lambda: arch.model_cls(cfg, "fp32", rngs=nnx.Rngs(0)))
    assert _independent_count(name, cfg, model) == expected


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/llama-tiny.yaml",
                                    "configs/rwkv7-hybrid-tiny.yaml"])
def test_shipped_tiny_configs_agree_with_their_parameter_tree(config):
    cfg = load_config(os.path.join(ROOT, config), data_files=False)
    arch = ARCHS[cfg.arch]
    model = nnx.eval_shape(lambda: arch.model_cls(cfg.model, "fp32", rngs=nnx.Rngs(0)))
    T_run = cfg.train.ctx_len
    assert arch.model_flops_per_token(cfg.model, T_run) == _independent_count(
        cfg.arch, cfg.model, model, T_run)


def test_the_0_1b_rwkv7_counts():
    """The figures the report quotes: the 0.1B config's 191.08M parameters, 140.75M without
    the embedding, WKV 9·C·N = 442,368 FLOPs per token and layer forward."""
    cfg = load_config(os.path.join(ROOT, "configs/rwkv7-0.1b.yaml"), data_files=False).model
    assert cfg.param_count() == RWKV_01B_PARAMS
    assert flops.matmul_params(cfg) == RWKV_01B_PARAMS - 65536 * 768 == 140_752_896
    assert flops.wkv_forward_flops(cfg) == 9 * 768 * 64 == 442_368
    per_token = flops.model_flops_per_token(cfg, 512)
    assert per_token == 6 * 140_752_896 + 3 * 12 * 442_368
    assert per_token / (6 * cfg.param_count()) == pytest.approx(0.7505, abs=1e-4)


def _log_one(tmp_path, model_flops_per_token, peak=1e12):
    tmp_path.mkdir(exist_ok=True)
    logger = MetricsLogger(str(tmp_path), n_params=RWKV_01B_PARAMS, tokens_per_step=4096,
                           total_steps=10, progress=False,
                           model_flops_per_token=model_flops_per_token)
    logger.peak = peak
    logger.reset_timer(0)
    time.sleep(0.05)
    rec = logger.log_train(3, {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "finite": 1.0,
                               "skipped_steps": 0.0})
    logger.close()
    return logger, rec


def test_record_has_model_mfu_below_mfu_when_the_embedding_is_large(tmp_path, capsys):
    cfg = load_config(os.path.join(ROOT, "configs/rwkv7-0.1b.yaml"), data_files=False).model
    per_token = flops.model_flops_per_token(cfg, 512)
    logger, rec = _log_one(tmp_path, per_token)
    assert rec["tflops"] == pytest.approx(6 * RWKV_01B_PARAMS * rec["tokens_per_s"] / 1e12)
    assert rec["model_tflops"] == pytest.approx(per_token * rec["tokens_per_s"] / 1e12)
    assert rec["model_mfu"] == pytest.approx(rec["model_tflops"] / logger.n_devices)
    assert rec["model_mfu"] < rec["mfu"]
    assert rec["model_mfu"] / rec["mfu"] == pytest.approx(per_token / (6 * RWKV_01B_PARAMS))
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0] == [rec]
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 3:")][0]
    m = re.search(r", MFU ([\d.]+)% \(model ([\d.]+)%\)$", line)
    assert m, line
    assert float(m.group(1)) == pytest.approx(100 * rec["mfu"], abs=0.06)
    assert float(m.group(2)) == pytest.approx(100 * rec["model_mfu"], abs=0.06)


def test_model_fields_are_null_without_a_count_or_a_peak(tmp_path, capsys):
    _, rec = _log_one(tmp_path / "a", None)
    assert rec["model_tflops"] is None and rec["model_mfu"] is None and rec["mfu"] > 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 3:")][0]
    assert "MFU" in line and "model" not in line
    _, rec = _log_one(tmp_path / "b", 1e9, peak=None)          # CPU: no peak
    assert rec["model_tflops"] > 0 and rec["model_mfu"] is None and rec["mfu"] is None


def _estimate_for(config, overrides=()):
    cfg = load_config(os.path.join(ROOT, config), list(overrides), data_files=False)
    chip = ChipSpec("test", "gpu", 1e15, 80 * 2**30, 1e9)     # slow memory: memory-bound
    train = types.SimpleNamespace(memory={"arguments": 10**9, "outputs": 0, "temp": 0})
    return cfg, _estimate(cfg, cfg.model.param_count(), 4, chip, train)


@pytest.mark.parametrize("config", ["configs/rwkv7-0.1b.yaml", "configs/llama-0.1b.yaml",
                                    "configs/rwkv7-hybrid-tiny.yaml"])
def test_plan_estimate_reports_both_mfus(config):
    cfg, est = _estimate_for(config)
    per_token = flops.model_flops_per_token(cfg.model, cfg.train.ctx_len)
    n = cfg.model.param_count()
    assert est.model_flops_per_token == per_token
    assert est.model_mfu / est.mfu == pytest.approx(per_token / (6 * n))
    tokens = cfg.train.batch_size * cfg.train.ctx_len
    mixer = per_token - 6 * flops.matmul_params(cfg.model)
    assert est.hardware_flops_per_chip == pytest.approx((6 * n + mixer) * tokens / 4)
    assert 0 < est.model_mfu <= 1 and 0 < est.mfu <= 1


def test_plan_model_mfu_never_passes_100_percent_when_compute_bound():
    """Long-context attention does more than 6 x parameters: the roofline counts it, so a
    compute-bound step's model MFU stays at or under 100%."""
    cfg = load_config(os.path.join(ROOT, "configs/llama-0.1b.yaml"), ["train.ctx_len=16384"],
                      data_files=False)
    fast_memory = ChipSpec("t", "gpu", 1e12, 80 * 2**30, 1e18)
    est = _estimate(cfg, cfg.model.param_count(), 1, fast_memory,
                    types.SimpleNamespace(memory={"arguments": 1, "outputs": 0, "temp": 0}))
    assert est.compute_s > est.memory_s and est.model_mfu > est.mfu
    assert est.model_mfu == pytest.approx(1.0)


def test_compile_printout_names_both_mfus():
    cfg, est = _estimate_for("configs/rwkv7-0.1b.yaml")
    chip = ChipSpec("test", "gpu", 1e15, 80 * 2**30, 1e9)
    plan = types.SimpleNamespace(cfg=cfg, target="t", slices=1, devices=4, device_kind="k",
                                 chip=chip, hbm=chip.hbm_bytes, mesh={"data": 4}, n_params=1,
                                 state_bytes={}, train=None, eval=None, estimate=est)
    text = "\n".join(aot_cli.describe(plan, "XLA"))
    assert f"MFU <= {100 * est.mfu:.1f}% (6 x all parameters; model MFU <= " \
           f"{100 * est.model_mfu:.1f}%" in text
