"""RWKV-7 ("Goose"): architecture config, model, block, TimeMix, ChannelMix, init, reference.

Modules: `config` (`ModelConfig`, architecture; imports no jax), `model` (`RWKV7`,
`RWKV7State`, `head_fn`, `probe_model_fn`), `block`, `time_mix`, `channel_mix`, `init` (the
official init), `reference` (float64 NumPy forward), `testing` (small configs and random weights for tests).
The model's names load on first use (PEP 562), so `lwm_jax.models.rwkv7.config` stays light.
"""
from lwm_jax._lazy import lazy_getattr

_SOURCES = {name: f"lwm_jax.models.rwkv7.{module}" for name, module in (
    ("RWKV7", "model"), ("RWKV7State", "model"), ("head_fn", "model"),
    ("probe_model_fn", "model"), ("ModelConfig", "config"))}
__all__ = list(_SOURCES)
__getattr__ = lazy_getattr(__name__, _SOURCES)
