"""Compile a run config's train and eval steps for a set of devices and read what XLA planned.

`compile_plan(cfg, devices, target=...)` builds the program `lwm-jax train` runs
(`lwm_jax.train.trainer.build_program`) on a mesh of `devices` — the compile-only devices of a
TPU topology, or the devices JAX sees — lowers both steps from shapes and shardings alone (no
array is allocated), compiles them with the real compiler of those devices (XLA:TPU and Mosaic
for a TPU topology) and returns a `Plan`:

- per chip: parameters, optimizer state and the rest of the train state (from the state's
  shardings), XLA's memory analysis of each compiled step (arguments, outputs not written in
  place, temporaries = activations and workspace), against the chip's HBM
  (`lwm_jax.hardware.CHIPS`);
- XLA's cost analysis (FLOPs, bytes accessed per chip). XLA counts a loop body once, so a
  layer scan or the chunked loss make these a fraction of the step's true work; the plan says so;
- a roofline estimate of the step time: the larger of the step's FLOPs at the chip's peak
  (`6 x parameters x tokens` as in the trainer's `mfu`, plus the sequence mixer's own FLOPs —
  attention scores, the WKV recurrence, `lwm_jax.models.flops` — plus the forward recomputed
  under remat) and the least memory traffic the compiled step implies at the chip's bandwidth
  (state read and written, every temporary written and read once), with the MFU that step
  time gives by both counts: `mfu` (6 x all parameters) and `model_mfu` (the field's
  convention, the trainer's `model_mfu`). It is an estimate, never a measurement:
  communication, kernel efficiency and the host are not in it.

A step that does not fit is a `ValueError` of one line naming the chip's HBM, the plan and the
keys that shrink it (`lwm_jax.train.preflight.check_step_fits`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp

from lwm_jax.hardware import ChipSpec, chip_spec, platform_of
from lwm_jax.models.flops import WEIGHT_FLOPS, matmul_params
from lwm_jax.models.registry import get_arch
from lwm_jax.train import batches
from lwm_jax.train.checkpoint import abstract_with_shardings
from lwm_jax.train.config import RunConfig
from lwm_jax.train.params import count_params
from lwm_jax.train.preflight import FIT_SLACK, check_step_fits, step_bytes
from lwm_jax.train.sharding import num_slices, tokens_sharding
from lwm_jax.train.trainer import TrainProgram, build_program

GiB = 2**30


@dataclasses.dataclass
class StepPlan:
    """One compiled step. `memory`: `preflight.step_bytes` (bytes per device); `flops`,
    `bytes_accessed`: XLA's cost analysis per device (loop bodies once; None if not reported);
    `matmul_operands`: the compiled program's matmuls counted by operand types
    (`matmul_operand_types`), e.g. `{"bf16 x bf16": 20, "f8e4m3fn x f8e4m3fn": 6}`."""

    name: str
    compile_s: float
    memory: dict[str, int] | None
    flops: float | None
    bytes_accessed: float | None
    matmul_operands: dict[str, int] = dataclasses.field(default_factory=dict)
    compiled: Any = dataclasses.field(repr=False, default=None)
    lowered: Any = dataclasses.field(repr=False, default=None)


@dataclasses.dataclass
class Estimate:
    """Roofline estimate of one train step (all chips together). Not a measurement.

    `mfu`: 6 x all parameters x tokens/s over the chips' peak; `model_mfu`: the same with
    `model_flops_per_token` (FLOPs per trained token, `lwm_jax.models.flops`) for 6 x
    parameters."""

    step_s: float
    compute_s: float
    memory_s: float
    hardware_flops_per_chip: float
    traffic_bytes_per_chip: float
    tokens_per_s: float
    mfu: float
    model_mfu: float
    model_flops_per_token: float


@dataclasses.dataclass
class Plan:
    """What `compile_plan` found. `state_bytes`: per chip, `{"params", "opt_state", "other"}`."""

    cfg: RunConfig
    target: str
    devices: int
    slices: int
    platform: str
    device_kind: str
    chip: ChipSpec | None
    mesh: dict[str, int]
    n_params: int
    tokens_per_step: int
    state_bytes: dict[str, int]
    train: StepPlan
    eval: StepPlan | None
    estimate: Estimate | None
    program: TrainProgram = dataclasses.field(repr=False, default=None)

    @property
    def hbm(self) -> int | None:
        return self.chip.hbm_bytes if self.chip is not None else None

    def to_dict(self) -> dict:
        """A JSON-ready summary (bytes, seconds, FLOPs as plain numbers)."""
        def step(s: StepPlan | None):
            if s is None:
                return None
            return {"compile_s": round(s.compile_s, 2), "memory": s.memory, "flops": s.flops,
                    "bytes_accessed": s.bytes_accessed, "matmul_operands": s.matmul_operands}
        est = dataclasses.asdict(self.estimate) if self.estimate is not None else None
        return {"config": self.cfg.name, "target": self.target, "devices": self.devices,
                "slices": self.slices, "platform": self.platform,
                "device_kind": self.device_kind,
                "chip": dataclasses.asdict(self.chip) if self.chip else None,
                "hbm_bytes": self.hbm, "mesh": self.mesh, "n_params": self.n_params,
                "tokens_per_step": self.tokens_per_step, "state_bytes": self.state_bytes,
                "train": step(self.train), "eval": step(self.eval), "estimate": est,
                "fits": self.fits()}

    def fits(self) -> bool:
        """Every compiled step's peak within `FIT_SLACK` of the chip's HBM (True when unknown)."""
        hbm = self.hbm
        return hbm is None or all(
            s is None or s.memory is None or s.memory["peak"] <= FIT_SLACK * hbm
            for s in (self.train, self.eval))


def _per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of `ShapeDtypeStruct`s with shardings (the largest
    shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


_HBM_OOM = re.compile(r"RESOURCE_EXHAUSTED:?\s*(.*)", re.S)


def _compile(name: str, lowered, cfg: RunConfig, target: str, kind: str) -> StepPlan:
    """Compile `lowered`; XLA's out-of-memory refusal becomes a one-line ValueError."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as err:              # XlaRuntimeError / JaxRuntimeError
        m = _HBM_OOM.search(str(err))
        if m is None:
            raise
        said = " ".join(m.group(1).split())[:300].rstrip(".")
        t = cfg.train
        raise ValueError(
            f"train.batch_size={t.batch_size}, train.ctx_len={t.ctx_len}: the {name} does not "
            f"fit one {kind} of {target} (XLA: {said}); lower train.batch_size (raise "
            "train.grad_accum to keep the sequences per step), lower train.ctx_len, raise "
            "mesh.fsdp to split the state over more chips, or set runtime.remat=true "
            "runtime.remat_policy=full") from None
    compile_s = time.perf_counter() - t0
    try:
        cost = compiled.cost_analysis() or {}
    except Exception:                     # not every backend implements it
        cost = {}
    if isinstance(cost, (list, tuple)):   # older jax: one dict per computation
        cost = cost[0] if cost else {}
    try:
        operands = matmul_operand_types(compiled.as_text())
    except Exception:                     # a backend without HLO text: nothing to count
        operands = {}
    return StepPlan(name, compile_s, step_bytes(compiled), cost.get("flops"),
                    cost.get("bytes accessed"), operands, compiled, lowered)


_HLO_TYPE = re.compile(r"%(\S+) = \(?([a-z]+[0-9a-z]*)\[")
_HLO_MATMUL = re.compile(r"= \S+?\[[^\]]*\]\S* (?:dot|convolution)\(%(\S+?), %(\S+?)\)")


def matmul_operand_types(hlo_text: str) -> dict[str, int]:
    """Count the `dot` / `convolution` instructions of compiled HLO text by their two
    operands' element types ("f8e4m3fn x f8e4m3fn"): which matmuls the compiler kept in FP8
    (an FP8 policy's block GEMMs) and which it runs in wider types. Each instruction of the
    text once (a loop body's matmul counts once)."""
    types = {m.group(1): m.group(2) for m in _HLO_TYPE.finditer(hlo_text)}
    counts: dict[str, int] = {}
    for m in _HLO_MATMUL.finditer(hlo_text):
        key = f"{types.get(m.group(1), '?')} x {types.get(m.group(2), '?')}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _estimate(cfg: RunConfig, n_params: int, n_devices: int, chip: ChipSpec | None,
              train: StepPlan) -> Estimate | None:
    """Roofline estimate of the train step (see the module docstring); None for unknown chips."""
    if chip is None or train.memory is None:
        return None
    t, rt = cfg.train, cfg.runtime
    tokens = t.batch_size * t.ctx_len
    per_token = get_arch(cfg.arch).model_flops_per_token(cfg.model, t.ctx_len)
    mixer_per_token = per_token - WEIGHT_FLOPS * matmul_params(cfg.model)
    all_params_flops = 6.0 * n_params * tokens               # what `mfu` counts
    remat_share = (sum(rt.rematerialized(i) for i in range(cfg.model.n_layer))
                   / max(1, cfg.model.n_layer)) if rt.remat and rt.remat_policy == "full" else 0
    executed = all_params_flops + float(mixer_per_token) * tokens
    hw_flops_chip = executed * (1 + remat_share / 3) / n_devices
    mem = train.memory
    traffic = mem["arguments"] + mem["outputs"] + 2 * mem["temp"]
    compute_s = hw_flops_chip / chip.peak_flops
    memory_s = traffic / chip.hbm_bytes_per_s
    step_s = max(compute_s, memory_s)
    capacity = step_s * chip.peak_flops * n_devices        # FLOPs the chips could do in a step
    return Estimate(step_s, compute_s, memory_s, hw_flops_chip, float(traffic), tokens / step_s,
                    all_params_flops / capacity, float(per_token) * tokens / capacity,
                    float(per_token))


def compile_plan(cfg: RunConfig, devices: list, *, target: str | None = None,
                 with_eval: bool = True) -> Plan:
    """Compile `cfg`'s train step (and eval step) for `devices`; see the module docstring.

    `target`: how to name the devices in messages (e.g. "v5p-128"); default their count and
    kind. Raises ValueError (one line) for a config that does not suit the devices (mesh,
    batch) or a step that does not fit a chip.
    """
    devices = list(devices)
    kind = str(devices[0].device_kind)
    target = target or f"{len(devices)} x {kind}"
    platform = platform_of(devices)
    chip = chip_spec(devices[0])
    prog = build_program(cfg, devices)
    t = cfg.train
    state = abstract_with_shardings(prog.abstract_state, prog.state_sh)
    tokens = jax.ShapeDtypeStruct(batches.global_batch_shape(t.batch_size, t.ctx_len + 1,
                                                             t.grad_accum), jnp.int32,
                                  sharding=tokens_sharding(prog.mesh, t.grad_accum > 1))
    what = f"{kind} chip" if platform == "tpu" else kind
    train = _compile("train step", prog.train_step.lower(state, tokens), cfg, target, what)
    ev = None
    if with_eval:
        eval_tokens = jax.ShapeDtypeStruct((t.batch_size, t.ctx_len + 1), jnp.int32,
                                           sharding=tokens_sharding(prog.mesh))
        ev = _compile("eval step", prog.eval_step.lower(state.params, state.fp8, eval_tokens), cfg,
                      target, what)
    n_params = count_params(prog.abstract_state.params)
    params_b = _per_device_bytes(state.params)
    opt_b = _per_device_bytes(state.opt_state)
    state_b = {"params": params_b, "opt_state": opt_b,
               "other": _per_device_bytes(state) - params_b - opt_b}
    plan = Plan(cfg, target, len(devices), num_slices(devices), platform, kind, chip,
                dict(prog.sizes), n_params, t.batch_size * t.ctx_len, state_b, train, ev,
                _estimate(cfg, n_params, len(devices), chip, train), prog)
    if chip is not None:
        have = (chip.hbm_bytes, f"HBM of one {what} ({target})")
        for step in (train, ev):
            if step is not None:
                check_step_fits(cfg, step.memory, *have, step=step.name, sizes=prog.sizes)
    return plan
