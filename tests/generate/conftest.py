"""Module-scoped fixtures of the small RWKV-7 in `generate_common`: its random parameters, the
model and a `Generator` (a test file may define its own `model` / `gen`, as the LLaMA one does)."""
import pytest

from generate_common import CFG
from lwm_jax.generate import Generator
from lwm_jax.interop.params import model_from_params
from lwm_jax.interop.testing import random_params


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=2)


@pytest.fixture(scope="module")
def model(tree):
    return model_from_params(CFG, tree)


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, prefill_chunk=8)
