"""Model families by name: what the trainer, the checkpoint readers and generation need to
build and run a model without knowing which family it is.

| arch    | config class                              | model class | head for the fused loss   |
|---------|-------------------------------------------|-------------|---------------------------|
| `rwkv7` | `lwm_jax.models.rwkv7.config.ModelConfig` | `RWKV7`     | `head_fn(policy)`         |
| `llama` | `lwm_jax.models.llama.config.LlamaConfig` | `Llama`     | `head_fn(policy, rms_eps)` |
| `rwkv7-hybrid` | `lwm_jax.models.hybrid.config.HybridConfig` | `RWKVHybrid` | `head_fn(policy)` |

Each family also names its model-FLOPs count (`Arch.model_flops_per_token`, the functions of
`lwm_jax.models.flops`: `rwkv7_flops_per_token`, `llama_flops_per_token`,
`hybrid_flops_per_token`).

Every model class takes `(cfg, policy, *, runtime=None, mesh=None, rngs)` and offers
`__call__(tokens_BT, state=None, return_state=False, segment_ids=None, probe=None)`,
`features`, `head_params`, `param_count` and `init_state`. A run config names its family with
the top-level key `arch` (default `rwkv7`). Classes are imported on first use: this module
imports no jax, so config parsing stays light.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Arch:
    """One family: where its config and model live (module paths, class names), and the name
    of its model-FLOPs function in `lwm_jax.models.flops`."""

    name: str
    config_module: str
    config_name: str
    model_module: str
    model_name: str
    flops_name: str

    def model_flops_per_token(self, cfg: Any, ctx_len: int) -> int:
        """Model FLOPs per trained token (forward + backward) of `cfg` at context `ctx_len`,
        by the field's MFU convention: `lwm_jax.models.flops.<flops_name>(cfg, ctx_len)`."""
        flops = importlib.import_module("lwm_jax.models.flops")
        return getattr(flops, self.flops_name)(cfg, ctx_len)

    @property
    def config_cls(self) -> type:
        return getattr(importlib.import_module(self.config_module), self.config_name)

    @property
    def model_cls(self) -> type:
        return getattr(importlib.import_module(self.model_module), self.model_name)

    @property
    def probe_model_fn(self) -> Callable:
        """`probe_model_fn(cfg, policy, runtime) -> (() -> model)` with remat and scan off."""
        return getattr(importlib.import_module(self.model_module), "probe_model_fn")

    def loss_head(self, model) -> Callable:
        """`f(x_BTC, model.head_params()) -> float32 logits` for this model (its final norm
        and head as a pure function, what `train.loss.fused_lm_loss` takes)."""
        module = importlib.import_module(self.model_module)
        if hasattr(module, "loss_head"):
            return module.loss_head(model)
        return module.head_fn(model.policy)


ARCHS: dict[str, Arch] = {
    "rwkv7": Arch("rwkv7", "lwm_jax.models.rwkv7.config", "ModelConfig",
                  "lwm_jax.models.rwkv7.model", "RWKV7", "rwkv7_flops_per_token"),
    "llama": Arch("llama", "lwm_jax.models.llama.config", "LlamaConfig",
                  "lwm_jax.models.llama.model", "Llama", "llama_flops_per_token"),
    "rwkv7-hybrid": Arch("rwkv7-hybrid", "lwm_jax.models.hybrid.config", "HybridConfig",
                         "lwm_jax.models.hybrid.model", "RWKVHybrid",
                         "hybrid_flops_per_token"),
}
DEFAULT_ARCH = "rwkv7"


def get_arch(name: Any) -> Arch:
    """The family called `name`; ValueError (one line) for an unknown one."""
    if name not in ARCHS:
        raise ValueError(f"arch: {name!r} is not one of {', '.join(ARCHS)}; set arch to one "
                         "of them")
    return ARCHS[name]


def arch_of_config(cfg: Any) -> Arch:
    """The family whose config class `cfg` is an instance of; TypeError otherwise."""
    for arch in ARCHS.values():
        if type(cfg).__name__ == arch.config_name and isinstance(cfg, arch.config_cls):
            return arch
    raise TypeError(f"model config must be one of "
                    f"{', '.join(a.config_name for a in ARCHS.values())}, got "
                    f"{type(cfg).__name__}")


def arch_of_model(model: Any) -> Arch:
    """The family whose model class `model` is an instance of; TypeError otherwise."""
    for arch in ARCHS.values():
        if type(model).__name__ == arch.model_name and isinstance(model, arch.model_cls):
            return arch
    raise TypeError(f"model must be one of {', '.join(a.model_name for a in ARCHS.values())}, "
                    f"got {type(model).__name__}")


def loss_head(model) -> Callable:
    """`arch_of_model(model).loss_head(model)`."""
    return arch_of_model(model).loss_head(model)
