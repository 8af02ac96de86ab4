"""`lwm-jax compile`: compile a run config's steps for a TPU topology (or the devices JAX sees)
on any host, print the per-chip plan, refuse one that does not fit, and save the step.

    lwm-jax compile --config configs/rwkv7-1.5b.yaml --topology v5p-128
    lwm-jax compile --config configs/tpu/v4-32-rwkv7-1.5b.yaml --topology v4-32 --save step.bin
    lwm-jax compile --config C --topology v5litepod-16 --num-slices 2 mesh.data=2 mesh.fsdp=-1

Exit 0: the plan fits (printed); 2: bad input, or a step that does not fit one chip (one line
naming the chip's HBM, the plan and what to change).
"""
from __future__ import annotations

import argparse
import json
import sys

from lwm_jax.aot.plan import GiB, Plan, compile_plan
from lwm_jax.precision import parse_policy


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f} GiB"


def policy_of(plan: Plan):
    return parse_policy(plan.cfg.precision)


def fp8_line(operands: dict[str, int], device_kind: str) -> str:
    """One line on an FP8 policy's compiled train step: how many of its matmuls the compiler
    kept with float8 operands (each FP8 GEMM is three: forward, two gradients)."""
    total = sum(operands.values())
    fp8 = sum(n for k, n in operands.items() if "f8" in k)
    if not operands:
        return "FP8 GEMMs: this backend gives no HLO text to count them"
    if fp8 == 0:
        return (f"FP8 GEMMs: none of the {total} matmuls kept float8 operands on {device_kind} "
                "(the compiler widened them: the policy costs FP8's accuracy for no speed here)")
    return (f"FP8 GEMMs: {fp8} of {total} matmuls take float8 operands on {device_kind} (e4m3 "
            "forward, e5m2 gradients; whether this chip multiplies FP8 natively is not "
            "measured by a compile)")


def describe(plan: Plan, compile_label: str) -> list[str]:
    """The plan as the lines `lwm-jax compile` prints."""
    chip = plan.chip
    hbm = plan.hbm
    mesh = " ".join(f"{k}={v}" for k, v in plan.mesh.items())
    slices = f" x {plan.slices} slices" if plan.slices > 1 else ""
    head = (f"{plan.cfg.name} for {plan.target}{slices}: {plan.devices} x {plan.device_kind}"
            + (f" ({_gib(hbm)} HBM, {chip.peak_flops / 1e12:.0f} TFLOP/s bf16 each)"
               if chip else "") + f"; mesh {mesh}; {plan.n_params:,} parameters")
    lines = [head]
    sb = plan.state_bytes
    for step in (plan.train, plan.eval):
        if step is None:
            continue
        mem = step.memory
        lines.append(f"  {step.name}: compiled by {compile_label} in {step.compile_s:.1f} s")
        if mem is None:
            lines.append("    (no memory analysis from this backend)")
            continue
        rows = []
        if step is plan.train:
            rows += [("parameters", sb["params"]), ("optimizer state", sb["opt_state"]),
                     ("batch, step counter, rng", mem["arguments"] - sb["params"]
                      - sb["opt_state"])]
        else:
            rows += [("arguments (parameters, batch)", mem["arguments"])]
        rows += [("activations + temporaries", mem["temp"]),
                 ("outputs not written in place", mem["outputs"] - mem["aliased"])]
        for label, n in rows:
            lines.append(f"    {label:<32}{_gib(n):>12}")
        share = f" of {_gib(hbm)} ({100 * mem['peak'] / hbm:.1f}%)" if hbm else ""
        lines.append(f"    {'total per chip':<32}{_gib(mem['peak']):>12}{share}")
        if policy_of(plan).fp8 and step is plan.train:
            lines.append(f"    {fp8_line(step.matmul_operands, plan.device_kind)}")
        if step.flops is not None:
            lines.append(f"    XLA cost analysis per chip: {step.flops / 1e12:.3f} TFLOP, "
                         f"{(step.bytes_accessed or 0) / 1e9:.2f} GB accessed (each loop body "
                         "counted once: a layer scan or the chunked loss count one iteration)")
    est = plan.estimate
    if est is not None:
        lines.append(
            f"  roofline ESTIMATE for {chip.name} (not a measurement; no communication, kernel "
            f"efficiency or host time): compute {est.hardware_flops_per_chip / 1e12:.1f} "
            f"TFLOP/chip at peak {est.compute_s:.3f} s, memory traffic floor "
            f"{est.traffic_bytes_per_chip / 1e9:.1f} GB/chip at {chip.hbm_bytes_per_s / 1e12:.2f}"
            f" TB/s {est.memory_s:.3f} s -> step >= {est.step_s:.3f} s, <= "
            f"{est.tokens_per_s:,.0f} tokens/s, MFU <= {100 * est.mfu:.1f}% (6 x all "
            f"parameters; model MFU <= {100 * est.model_mfu:.1f}%: 6 x non-embedding "
            f"parameters + attention/WKV, {est.model_flops_per_token / 1e9:.3g} GFLOP/token)")
    return lines


def compile_main(args: argparse.Namespace) -> int:
    """`lwm-jax compile` (see the module docstring). Returns the exit status."""
    from lwm_jax.train.config import load_config

    cfg = load_config(args.config, args.overrides, data_files=False)
    if args.topology is None:
        import jax
        devices, target, label = list(jax.devices()), None, "XLA"
        if args.num_slices != 1:
            raise ValueError("--num-slices: needs --topology (slices of a TPU topology)")
    else:
        from lwm_jax.aot.topology import parse_topology, topology_devices
        topo = parse_topology(args.topology)
        devices = topology_devices(topo, args.num_slices)
        target, label = topo.name, "XLA:TPU + Mosaic"
    if args.compilation_cache:
        from lwm_jax.train.compile_cache import enable_compilation_cache
        enable_compilation_cache(args.compilation_cache)
    plan = compile_plan(cfg, devices, target=target, with_eval=not args.no_eval)
    if args.save is not None:
        from lwm_jax.train.saved_step import save_compiled
        save_compiled(args.save, plan.train.compiled, plan.train.lowered, cfg, devices,
                      target or plan.device_kind)
    if args.json:
        print(json.dumps(plan.to_dict(), sort_keys=True))
    else:
        for line in describe(plan, label):
            print(line)
        if args.save is not None:
            print(f"  saved the compiled train step to {args.save}; on the slice: "
                  f"lwm-jax train --config <same config> --compiled {args.save}")
    sys.stdout.flush()
    return 0
