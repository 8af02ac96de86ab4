"""Compile every shipped config for the TPU topology it is meant for (no TPU needed) and print
the table of docs/tpu.md: config, topology, per-chip GiB of the train step against the chip's
HBM, compile seconds, and the roofline estimate (an estimate, never a measurement).

    python tools/tpu_compile_table.py [--out plans.jsonl] [NAME ...]
    python tools/tpu_compile_table.py --from plans.jsonl     # the table of saved plans

Each row runs `lwm-jax compile --json` in its own process (one compile at a time: they use
every core). NAME picks rows by config file stem (default: all of `ROWS`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

# (config, topology, extra arguments): where each shipped config is meant to run.
ROWS = (
    ("configs/tiny.yaml", "v5litepod-4", []),
    ("configs/llama-tiny.yaml", "v5litepod-4", []),
    ("configs/rwkv7-hybrid-tiny.yaml", "v5litepod-4", []),
    ("configs/rwkv7-0.1b.yaml", "v6e-8", []),
    ("configs/llama-0.1b.yaml", "v6e-8", []),
    ("configs/rwkv7-0.4b.yaml", "v5litepod-16", []),
    ("configs/rwkv7-1.5b.yaml", "v5p-128", []),
    ("configs/rwkv7-2.9b.yaml", "v5p-128", []),
    ("configs/llama-1b.yaml", "v5p-8", []),
    ("configs/llama-1b.yaml", "v6e-8", ["mesh.data=1", "mesh.fsdp=-1"]),
    ("configs/tpu/v4-32-rwkv7-1.5b.yaml", "v4-32", []),
    ("configs/tpu/v5p-128-rwkv7-2.9b.yaml", "v5p-128", []),
    ("configs/tpu/v4-32-rwkv7-1.5b.yaml", "v4-32", ["--num-slices", "2", "mesh.data=2"]),
)


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 0.1 else f"{x * 1e3:.2f} ms"


def row(plan: dict, config: str, topology: str, extra: list[str]) -> str:
    """One markdown row of a `lwm-jax compile --json` plan."""
    label = topology + (f" x{extra[extra.index('--num-slices') + 1]}"
                        if "--num-slices" in extra else "")
    gib = lambda s: s["memory"]["peak"] / 2**30 if s else float("nan")  # noqa: E731
    ev, est = plan["eval"], plan["estimate"]
    return (f"| `{config}` {' '.join(e for e in extra if '=' in e)} | {label} | "
            f"{plan['devices']} | {gib(plan['train']):.2f} / {gib(ev):.2f} of "
            f"{plan['hbm_bytes'] / 2**30:.0f} | {plan['train']['compile_s']:.0f} / "
            f"{ev['compile_s'] if ev else 0:.0f} | {_seconds(est['step_s'])}, "
            f"{est['tokens_per_s']:,.0f}, {100 * est['mfu']:.0f}% |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also append each row's JSON plan to this file")
    ap.add_argument("--from", dest="source", metavar="JSONL",
                    help="print the table of plans saved with --out instead of compiling")
    ap.add_argument("names", nargs="*", help="config stems to run (default: all)")
    args = ap.parse_args()
    print("| config | topology | chips | per-chip GiB (train / eval) of HBM | compile s "
          "(train / eval) | roofline estimate: step, tokens/s, MFU |")
    print("|---|---|---|---|---|---|")
    if args.source:
        with open(args.source, encoding="utf-8") as f:
            for line in f:
                plan = json.loads(line)
                cmd = plan["cmd"]
                config, topology = cmd[cmd.index("--config") + 1], cmd[cmd.index("--topology") + 1]
                extra = cmd[cmd.index("--json") + 1:]
                print(row(plan, config, topology, extra))
        return 0
    status = 0
    for config, topology, extra in ROWS:
        stem = config.rsplit("/", 1)[-1].removesuffix(".yaml")
        if args.names and stem not in args.names:
            continue
        cmd = ["lwm-jax", "compile", "--config", config, "--topology", topology, "--json",
               *extra]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if run.returncode != 0:
            status = 1
            print(f"| `{config}` {' '.join(extra)} | {topology} | | FAILED "
                  f"({run.returncode}): {run.stderr.strip()[-300:]} | {wall:.0f} | |")
            continue
        plan = json.loads(run.stdout)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({"cmd": cmd, **plan}) + "\n")
        print(row(plan, config, topology, extra), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
