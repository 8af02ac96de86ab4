"""Training on a GPU: the flagship recipe stays finite, and the XLA fallback fits in memory.

GPU only (skipped elsewhere, always in CI). Run on a GPU machine with
`python -m pytest -q tests/train/test_gpu_training.py`. These are the runs that found the bf16-mixed
NaN (docs/precision-nan.md): `configs/rwkv7-0.1b.yaml` under `bf16-mixed`, V = 65536, batch
8 x 4096, fresh uniformly random tokens every step, the config's own optimizer recipe.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.train.config import load_config
from lwm_jax.train.sharding import tokens_sharding
from lwm_jax.train.trainer import build_program

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

RECIPE = ["data.path=null", "data.tokenizer=byte", "precision=bf16-mixed",
          "train.batch_size=8", "train.ctx_len=4096"]


def test_0p1b_bf16_mixed_trains_100_steps_on_random_tokens_without_a_nonfinite_loss():
    cfg = load_config("configs/rwkv7-0.1b.yaml", RECIPE)
    prog = build_program(cfg)
    state = prog.init_state()
    sh = tokens_sharding(prog.mesh)
    key = jax.random.PRNGKey(0)
    losses, skipped = [], 0.0
    for step in range(100):
        tokens = jax.device_put(jax.random.randint(jax.random.fold_in(key, step), (8, 4097), 0,
                                                   cfg.model.vocab_size), sh)
        state, m = prog.train_step(state, tokens)
        losses.append(float(m["loss"]))
        skipped = float(m["skipped_steps"])
    assert np.isfinite(losses).all(), [i + 1 for i, x in enumerate(losses) if not np.isfinite(x)]
    assert skipped == 0
    # uniform random targets: the best possible loss is ln V = 11.09
    assert abs(np.mean(losses[-10:]) - np.log(cfg.model.vocab_size)) < 0.3


def test_chunked_fallback_step_compiles_within_the_gpu_memory():
    """The pure-XLA WKV (the path for backends without our kernel) at the same shape asked XLA
    for 110 GiB before its chunk terms were grouped and checkpointed."""
    cfg = load_config("configs/rwkv7-0.1b.yaml", [*RECIPE, "runtime.wkv_impl=chunked"])
    prog = build_program(cfg)
    tokens = jax.ShapeDtypeStruct((8, 4097), jnp.int32)
    mem = prog.train_step.lower(prog.abstract_state, tokens).compile().memory_analysis()
    need = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    have = jax.devices()[0].memory_stats()["bytes_limit"]
    print(f"chunked fallback train step: {need / 2**30:.1f} GiB of {have / 2**30:.1f} GiB")
    assert need < have, f"{need / 2**30:.1f} GiB needed, {have / 2**30:.1f} GiB on the device"
