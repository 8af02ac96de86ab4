"""The small RWKV-7 the generation tests share (its config, greedy sampling, the relative
error); the fixtures building it are in this folder's conftest.py."""
import numpy as np

from lwm_jax.generate import SamplingParams
from lwm_jax.models.rwkv7.config import ModelConfig

CFG = ModelConfig(vocab_size=256, n_layer=2, n_embd=64, head_size=32, decay_lora=16, a_lora=16,
                  v_lora=16, gate_lora=32).resolved()
GREEDY = SamplingParams(temperature=0.0)


def rel(a, b) -> float:
    """`||a - b|| / ||b||` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
