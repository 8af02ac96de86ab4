"""LLaMA-style decoder: config (`LlamaConfig`, `RopeScaling`; imports no jax), model (`Llama`,
`head_fn`, `loss_head`, `probe_model_fn`), block (`Block`, `block_forward`), `reference`
(float64 NumPy forward for tests). Names load on first use (PEP 562).
"""
from lwm_jax._lazy import lazy_getattr

_SOURCES = {name: f"lwm_jax.models.llama.{module}" for name, module in (
    ("Llama", "model"), ("head_fn", "model"), ("loss_head", "model"),
    ("probe_model_fn", "model"), ("LlamaConfig", "config"), ("RopeScaling", "config"))}
__all__ = list(_SOURCES)
__getattr__ = lazy_getattr(__name__, _SOURCES)
