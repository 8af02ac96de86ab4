"""The sections of a training run's config as frozen dataclasses, and `RunConfig`, which holds
them; their defaults are the tiny run. Loading, overrides and validation are in
`lwm_jax.train.config` (the import path for all of these) and `lwm_jax.train.config_validation`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from lwm_jax.models.registry import DEFAULT_ARCH
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.runtime import Runtime

# The tiny model: L4 D256 byte-level, 3.6M parameters.
TINY_MODEL = ModelConfig(vocab_size=256, n_layer=4, n_embd=256, head_size=64)


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """Optimiser and loop settings.

    lr / min_lr: peak and final learning rate (cosine from lr to min_lr after warmup).
    warmup_steps: steps of the RWKV-LM warmup multiplier 0.01 + 0.99·step/warmup_steps.
    steps: optimizer steps in the run.
    batch_size: sequences per optimizer step (global, across devices and micro-batches).
    ctx_len: tokens per sequence (the model sees ctx_len tokens and predicts the next ctx_len).
    grad_accum: micro-batches per step (batch_size / grad_accum sequences each, summed exactly).
    weight_decay: decoupled AdamW decay, applied to projection/embedding/head matrices only.
    betas, eps: AdamW moment decay rates and epsilon (moments are always float32).
    grad_clip: global-norm clip threshold (0 = no clipping).
    l2wrap: add RWKV-LM's L2Wrap gradient on each position's max logit.
    seed: initialisation / data-order seed.
    eval_every: validation every this many steps (0 = only at the end).
    eval_batches: batches of `batch_size` sequences per validation.
    log_every: steps between metric records.
    loss_chunk: tokens (summed over the batch rows) whose logits exist at once in the loss: the
      fused loss computes logits, cross-entropy and their gradient chunk by chunk, so
      `[B, T, V]` float32 logits never exist. 0 = unfused (all logits at once).
    max_consecutive_skips: stop the run after this many optimizer steps in a row were skipped
      because the loss or a gradient was non-finite (their update is never applied; under
      fp16 loss scaling only skips at the minimum loss scale count). 0 = never stop.
    profile_steps: `[start, stop]`: write a `jax.profiler` trace of optimizer steps
      start..stop-1 (0-based; a call's first step includes compilation) to
      `<run_dir>/profile/` (`lwm_jax.train.profiling`); null = no trace.
    """

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    steps: int = 150
    batch_size: int = 16
    ctx_len: int = 128
    grad_accum: int = 1
    weight_decay: float = 0.001
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-18
    grad_clip: float = 1.0
    l2wrap: bool = True
    seed: int = 0
    eval_every: int = 25
    eval_batches: int = 4
    log_every: int = 5
    loss_chunk: int = 4096
    max_consecutive_skips: int = 8
    profile_steps: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Training data.

    path: prefix of a binidx pair (`<path>.bin` + `<path>.idx`), or null for the embedded default
      corpus (Python standard-library sources, byte-level tokenised, with a held-out split), or
      text tokenised on the fly (`lwm_jax.data.text_sources`): a directory of / a `.jsonl`,
      `.parquet` or `.txt` file, or `hf:<dataset>[:<config>[:<split>]]` (streamed `datasets`).
    val_path: prefix of a separate validation binidx pair; null = hold out `val_fraction` of
      `path`'s documents.
    tokenizer: "byte", "world[:vocab_path]" or "hf:path/to/tokenizer.json"; it must match the
      tokenizer the binidx was written with (only its vocabulary size is used in training).
    val_fraction: fraction of the documents held out for validation when `val_path` is null
      (0 = no validation): a binidx `path` gives its last documents; text and `hf:` sources
      each document whose text hashes below the fraction (`lwm_jax.data.text_sources`: the
      same split in every run and resume); in a mixture every source holds out its own.
    sources / weights: a weighted mixture instead of `path`: any of the `path` forms above, and
      one positive weight each (empty = equal weights); each batch row picks a source by a
      seeded draw (`lwm_jax.data.mixture`).
    text_key: the field (`.jsonl`, `datasets`) or column (`.parquet`) holding the text.
    reset_at_document_boundary: restart the model's state at every document inside a training
      window: segment ids from the end-of-document token (the tokenizer's `eod_id`, 0 for byte
      and World) reset the RWKV-7 state and token shift, and confine Llama attention and RoPE
      positions, so no document sees the one before it. False (default) trains as RWKV-LM
      does: documents concatenated, separated by the EOD token, state flowing across it.
    """

    path: str | None = None
    val_path: str | None = None
    tokenizer: str = "byte"
    val_fraction: float = 0.05
    reset_at_document_boundary: bool = False
    sources: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    text_key: str = "text"


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints (orbax). dir: null = `<run_dir>/checkpoints`. every: steps between saves
    (0 = only at the end). keep: newest checkpoints kept. async: save in a background thread."""

    dir: str | None = None
    every: int = 50
    keep: int = 3
    async_: bool = True


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device-mesh axis sizes; exactly one may be -1 (= all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Where training records go (`lwm_jax.train.trackers`); only process 0 writes.

    trackers: any of `jsonl` (`metrics.jsonl`, which also draws `loss_curve.png`),
      `tensorboard` (tensorboardX events in `<run_dir>/tb`; without tensorboardX the run says
      so in one line and goes on), `wandb` (Weights & Biases; needs `wandb`;
      `WANDB_MODE=offline` keeps it on disk in `<run_dir>/wandb/`).
    wandb_project / wandb_entity: the W&B project, and entity (null = your default entity).
    """

    trackers: tuple[str, ...] = ("jsonl", "tensorboard")
    wandb_project: str = "lwm-jax"
    wandb_entity: str | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole training run. name: run name (default run dir `runs/<name>`); run_dir: null =
    `runs/<name>` relative to the working directory; precision: a `parse_policy` string;
    arch: the model family (`lwm_jax.models.registry.ARCHS`), which decides the `model` type
    (a `ModelConfig` for rwkv7, a `LlamaConfig` for llama)."""

    name: str = "tiny"
    run_dir: str | None = None
    precision: str = "fp32"
    arch: str = DEFAULT_ARCH
    model: Any = TINY_MODEL
    runtime: Runtime = Runtime()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    logging: LoggingSection = LoggingSection()

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join("runs", self.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.resolved_run_dir, "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able dict (the inverse of `build_config`)."""
        out: dict[str, Any] = {"name": self.name, "run_dir": self.run_dir,
                               "precision": self.precision, "arch": self.arch,
                               "model": self.model.to_dict()}
        for sec in SECTIONS:
            d = dataclasses.asdict(getattr(self, sec))
            out[sec] = {yaml_key(k): list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS = {"runtime": Runtime, "train": TrainSection, "data": DataSection,
            "checkpoint": CheckpointSection, "mesh": MeshSection, "logging": LoggingSection}
TOP_SCALARS = ("name", "run_dir", "precision", "arch")


def yaml_key(field_name: str) -> str:
    """A field's key in YAML."""
    return field_name.rstrip("_")          # `async_` is spelled `async` in YAML
