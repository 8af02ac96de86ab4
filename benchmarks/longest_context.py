"""The longest context one train step fits in, found from XLA's memory analysis, then trained.

For a candidate context T (batch 1 unless `--set train.batch_size=...`), the train step that
`lwm-jax train` builds is compiled (not run) and XLA's memory analysis of it (arguments +
outputs - aliases + temporaries per device, what the trainer's pre-flight checks,
`lwm_jax/train/preflight.py`) is compared with the device's `bytes_limit` times the pre-flight's
slack. A binary search over multiples of `--multiple` tokens between `--lo` and `--hi` finds the
largest T that fits; with `--run` that T is then trained for a few steps on random tokens
(`benchmarks/train_step.py`'s timer, its own process) to show the plan holds: tokens/s and the
allocator's peak. One JSON line per probe and a summary line.

`--search-untuned` compiles the probes without XLA's GEMM autotuning (minutes saved per probe on
a GPU) while the trained steps keep it: untuned, the 0.1B step at 524288 tokens ran 7x slower
on an H100 (24.7 s vs 3.5 s), and its plan was 3 GiB below the tuned step's (59.1 vs 62.1 GiB),
which the pre-flight's slack absorbs.

    python benchmarks/longest_context.py --model 0.1b --run \
        --set runtime.remat=true runtime.scan_layers=true
    python benchmarks/longest_context.py --model 0.1b --run --set mesh.data=1 mesh.sequence=2 ...
    python benchmarks/longest_context.py --model tiny --limit-gib 2 --lo 1024 --hi 65536 \
        --multiple 1024                                                 # CPU: a given limit

On a CPU the limit must be given (`--limit-gib`): the host's memory is not a device's. The CPU
analysis also differs from a GPU's (the CPU runs the chunked XLA WKV): search on the device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import MODELS, case_config  # noqa: E402  (the throughput bench's cases)


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int, multiple: int) -> int | None:
    """The largest multiple of `multiple` in [lo, hi] for which `fits` is True, assuming `fits`
    is monotone (True up to some T, False above); None if not even `lo` fits."""
    lo_k, hi_k = -(-lo // multiple), hi // multiple
    if lo_k > hi_k or not fits(lo_k * multiple):
        return None
    while lo_k < hi_k:                       # invariant: lo_k fits
        mid = (lo_k + hi_k + 1) // 2
        if fits(mid * multiple):
            lo_k = mid
        else:
            hi_k = mid - 1
    return lo_k * multiple


def planned_bytes(model: str, precision: str, ctx: int, overrides: list[str]):
    """`(run config, XLA's memory analysis in bytes per device)` of the train step at context
    `ctx` (batch 1 unless `overrides` say otherwise), compiled and not run."""
    import jax
    import numpy as np

    from lwm_jax.train.preflight import step_bytes
    from lwm_jax.train.sharding import tokens_sharding
    from lwm_jax.train.trainer import build_program

    cfg = case_config(model, precision, ["train.batch_size=1", *overrides, f"train.ctx_len={ctx}"])
    prog = build_program(cfg)
    tokens = jax.ShapeDtypeStruct((cfg.train.batch_size, ctx + 1), np.int32,
                                  sharding=tokens_sharding(prog.mesh))
    compiled = prog.train_step.lower(prog.abstract_state, tokens).compile()
    return cfg, step_bytes(compiled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="0.1b", choices=sorted(MODELS))
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="dotted config overrides (runtime.remat=true, mesh.sequence=2, ...)")
    ap.add_argument("--lo", type=int, default=1 << 20, help="smallest context tried (tokens)")
    ap.add_argument("--hi", type=int, default=1 << 23, help="largest context tried (tokens)")
    ap.add_argument("--multiple", type=int, default=1 << 16,
                    help="contexts tried are multiples of this (the WKV chunk, the loss chunk "
                         "and mesh.sequence must divide it)")
    ap.add_argument("--limit-gib", type=float, default=None,
                    help="memory per device to fit in (default: the device's bytes_limit)")
    ap.add_argument("--run", action="store_true", help="train the largest fitting context")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--search-untuned", action="store_true",
                    help="compile the search's probes without XLA's GEMM autotuning (each probe "
                         "is then a plain compile); the --run steps keep the caller's flags")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args()

    run_env = dict(os.environ)          # what the trained steps run with
    if args.search_untuned:             # before jax reads XLA_FLAGS
        os.environ["XLA_FLAGS"] = " ".join(
            f for f in (os.environ.get("XLA_FLAGS"), "--xla_gpu_autotune_level=0") if f)
    import jax

    from lwm_jax.train.preflight import check_step_fits, device_memory

    dev = jax.local_devices()[0]
    if args.limit_gib is not None:
        limit = int(args.limit_gib * 2**30)
    else:
        limit = device_memory()[0] if dev.platform != "cpu" else None   # not the host's
        if not limit:
            sys.exit("longest_context: this device reports no memory limit; pass --limit-gib")

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def fits(ctx: int) -> bool:
        t0 = time.perf_counter()
        try:
            cfg, plan = planned_bytes(args.model, args.precision, ctx, args.set)
        except Exception as err:        # noqa: BLE001 -- e.g. the compiler itself runs out
            emit({"ctx": ctx, "fits": False, "error": f"{type(err).__name__}: {err}"[:300]})
            return False
        if not plan:
            sys.exit("longest_context: XLA reports no memory analysis on this backend")
        try:                            # the trainer's own pre-flight rule, slack included
            check_step_fits(cfg, plan, limit, "the limit")
            ok = True
        except ValueError:
            ok = False
        emit({"ctx": ctx, "fits": ok, "planned_gib": round(plan["peak"] / 2**30, 2),
              "limit_gib": round(limit / 2**30, 2),
              "compile_s": round(time.perf_counter() - t0, 1)})
        return ok

    best = largest_fitting(fits, args.lo, args.hi, args.multiple)
    summary = {"model": args.model, "precision": args.precision, "overrides": args.set,
               "device": dev.device_kind,
               "devices": jax.device_count(), "jax": jax.__version__, "largest_ctx": best,
               "searched": [args.lo, args.hi, args.multiple]}
    if best is not None and args.run:
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "train_step.py"), "--models", args.model,
               "--precisions", args.precision, "--steps", str(args.steps), "--warmup", "1",
               "--set", "train.batch_size=1", *args.set, f"train.ctx_len={best}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
        rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        summary["run"] = rows[-1] if rows else {"error": proc.stderr.strip()[-300:]}
    emit(summary)


if __name__ == "__main__":
    main()
