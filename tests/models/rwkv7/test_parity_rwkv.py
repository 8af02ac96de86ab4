"""Parity with the official `rwkv` pip package (RWKV_V7_ON=1, strategy "cpu fp32").

A random official-layout checkpoint (init-formula vectors plus noise, Gaussian matrices so that
W_o, ffn.value and the first LoRA matrices are non-zero) is written as bf16 `.pth` with our
exporter, then run by the `rwkv` package and by our importer + model. The package reads the
official layout itself, so a naming, transposition or reshaping mistake on either side shows up
as a logit mismatch.
"""
from __future__ import annotations

import copy
import os

import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import load_pretrained, rwkv_pth
from lwm_jax.interop.testing import random_params

pytest.importorskip("torch")
os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
rwkv_model = pytest.importorskip("rwkv.model")

CFG = ModelConfig(vocab_size=300, n_layer=2, n_embd=128, head_size=64, decay_lora=32, a_lora=16,
                  v_lora=24, gate_lora=48)
TOL = 1e-4


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity") / "rand.pth"
    rwkv_pth.save_pth(CFG.resolved(), random_params(CFG, seed=11), path, dtype="bf16")
    ours, _ = load_pretrained(path)
    ref = rwkv_model.RWKV(str(path)[: -len(".pth")], "cpu fp32")
    return ours, ref


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(7).integers(0, CFG.vocab_size, 100).tolist()


@pytest.mark.parametrize("T", [1, 40, 100])
def test_logits_match_official_package(pair, tokens, T):
    ours, ref = pair
    got = np.asarray(ours(jnp.asarray([tokens[:T]])))[0]
    if T == 1:
        want = ref.forward(tokens[0], None)[0].numpy()[None]
    else:
        want = ref.forward(tokens[:T], None, full_output=True)[0].numpy()
    assert got.shape == want.shape == (T, CFG.vocab_size)
    assert np.std(want) > 0.1           # logits are far from trivial
    assert rel(got, want) < TOL


def test_stateful_continuation_matches_official_package(pair, tokens):
    ours, ref = pair
    _, ref_state = ref.forward(tokens[:60], None)
    want, ref_state = ref.forward(tokens[60:], copy.deepcopy(ref_state), full_output=True)
    _, state = ours(jnp.asarray([tokens[:60]]), return_state=True)
    got, state = ours(jnp.asarray([tokens[60:]]), state=state, return_state=True)
    assert rel(np.asarray(got)[0], want.numpy()) < TOL
    for i in range(CFG.n_layer):
        # official state per layer: [TimeMix x_prev, WKV S[value, key], ChannelMix x_prev]
        assert rel(state.tmix_shift[i, 0], ref_state[3 * i].numpy()) < TOL
        assert rel(np.swapaxes(np.asarray(state.wkv[i, 0]), -1, -2), ref_state[3 * i + 1].numpy()) < TOL
        assert rel(state.cmix_shift[i, 0], ref_state[3 * i + 2].numpy()) < TOL
    # one more token through the package's single-token path
    want_one = ref.forward(tokens[0], ref_state)[0].numpy()
    got_one = np.asarray(ours(jnp.asarray([[tokens[0]]]), state=state))[0, 0]
    assert rel(got_one, want_one) < TOL
