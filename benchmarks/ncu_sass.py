"""Where one kernel launch spends its time, instruction by instruction, from Nsight Compute.

    ncu --kernel-name regex:NAME --launch-skip 3 --launch-count 1 --set full -o REP python3 ...
    ncu --import REP.ncu-rep --page source --csv --print-source sass > NAME.csv
    python3 benchmarks/ncu_sass.py NAME.csv [--top 20] [--json F]

Reads the source page (one CSV row per SASS instruction of the profiled launch) and prints, per
opcode, the instructions executed per warp and the opcode's share of the warp-stall samples with
its leading stall reasons; the stall reasons over the whole kernel; the shared-memory wavefronts
each opcode issued against the conflict-free ideal (the excess is bank conflicts); and the runs of
consecutive shared-memory stores that carry most of that excess (a tile written to shared memory
in an order its registers do not hold it in, e.g. a product operand stored transposed). XLA
compiles Triton kernels without line information, so instructions are located by their index in
the listing. Standard library only, so it runs where the report was taken.
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
WAVEFRONTS = "L1 Wavefronts Shared"
IDEAL = "L1 Wavefronts Shared Ideal"
EXCESS = "L1 Wavefronts Shared Excessive"
_OPCODE = re.compile(r"(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def _int(text: str) -> int:
    text = (text or "").replace(",", "").strip()
    return int(float(text)) if text and text != "-" else 0


def read(path: str) -> tuple[str, list[dict]]:
    """(kernel name, one dict per instruction: index, opcode, text, executed, samples, reasons
    {stall reason: samples}, wavefronts, ideal, excess)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if start is None:
        raise SystemExit(f"ncu_sass: {path}: no 'Source' column; export it with "
                         "`ncu --import REP --page source --csv --print-source sass`")
    kernel = rows[0][1] if start > 0 and len(rows[0]) > 1 else "?"
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for index, r in enumerate(rows[start + 1:]):
        if len(r) < len(header):
            continue
        text = r[col["Source"]].strip()
        m = _OPCODE.match(text)
        get = lambda name: _int(r[col[name]]) if name in col else 0   # noqa: E731
        out.append({"index": index, "opcode": m.group(1) if m else "?", "text": text,
                    "executed": get(EXECUTED), "samples": get(SAMPLES),
                    "reasons": {h[len("stall_"):]: _int(r[col[h]]) for h in reasons},
                    "wavefronts": get(WAVEFRONTS), "ideal": get(IDEAL), "excess": get(EXCESS)})
    return kernel, out


def store_runs(instrs: list[dict], gap: int = 12) -> list[dict]:
    """Runs of shared-memory stores (STS*) with excess wavefronts, at most `gap` instructions
    apart: where one tile goes to shared memory with bank conflicts. Largest excess first."""
    runs: list[dict] = []
    for ins in instrs:
        if not ins["opcode"].startswith("STS") or ins["excess"] <= 0:
            continue
        if runs and ins["index"] - runs[-1]["last"] <= gap:
            run = runs[-1]
            run["last"] = ins["index"]
            run["stores"] += 1
            run["excess"] += ins["excess"]
            run["wavefronts"] += ins["wavefronts"]
        else:
            runs.append({"first": ins["index"], "last": ins["index"], "stores": 1,
                         "excess": ins["excess"], "wavefronts": ins["wavefronts"]})
    return sorted(runs, key=lambda run: -run["excess"])


def summarize(instrs: list[dict], top: int = 20) -> dict:
    """Per-opcode mix and stalls, stall reasons, shared-memory excess by opcode, store runs."""
    # the first instruction runs once a warp: its count is the number of warps
    warps = max(instrs[0]["executed"], 1) if instrs else 1
    samples = sum(i["samples"] for i in instrs) or 1
    by_op: dict[str, dict] = {}
    reasons_all: collections.Counter = collections.Counter()
    for ins in instrs:
        op = by_op.setdefault(ins["opcode"], {"executed": 0, "samples": 0, "wavefronts": 0,
                                              "ideal": 0, "excess": 0,
                                              "reasons": collections.Counter()})
        for key in ("executed", "samples", "wavefronts", "ideal", "excess"):
            op[key] += ins[key]
        op["reasons"].update(ins["reasons"])
        reasons_all.update(ins["reasons"])
    reason_total = sum(reasons_all.values()) or 1
    opcodes = [{"opcode": name, "per_warp": round(v["executed"] / warps, 1),
                "sample_pct": round(100 * v["samples"] / samples, 1),
                "reasons_pct": {k: round(100 * n / reason_total, 1)
                                for k, n in v["reasons"].most_common(3) if n}}
               for name, v in sorted(by_op.items(), key=lambda kv: -kv[1]["samples"])[:top]]
    shared = [{"opcode": name, "wavefronts": v["wavefronts"], "ideal": v["ideal"],
               "excess": v["excess"]}
              for name, v in sorted(by_op.items(), key=lambda kv: -kv[1]["excess"])
              if v["wavefronts"]]
    excess = sum(v["excess"] for v in by_op.values())
    wavefronts = sum(v["wavefronts"] for v in by_op.values())
    runs = store_runs(instrs)
    return {"instructions": len(instrs), "executed_per_warp": round(
                sum(i["executed"] for i in instrs) / warps, 1),
            "stall_reasons_pct": {k: round(100 * n / reason_total, 1)
                                  for k, n in reasons_all.most_common(10) if n},
            "opcodes": opcodes,
            "shared_wavefronts": wavefronts, "shared_excess": excess,
            "shared_by_opcode": shared,
            "store_runs": [dict(run, excess_pct=round(100 * run["excess"] / max(excess, 1), 1))
                           for run in runs[:top]]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="`ncu --import REP --page source --csv --print-source sass` output")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    kernel, instrs = read(args.csv)
    s = summarize(instrs, args.top)
    print(f"{kernel}: {s['instructions']} SASS instructions, {s['executed_per_warp']} executed "
          "per warp")
    print("stall reasons, % of samples: " + ", ".join(
        f"{k} {v}" for k, v in s["stall_reasons_pct"].items()))
    print("opcode      per warp  % samples  leading reasons (% of all samples)")
    for o in s["opcodes"]:
        print(f"  {o['opcode']:10s} {o['per_warp']:8.0f} {o['sample_pct']:9.1f}  " + ", ".join(
            f"{k} {v}" for k, v in o["reasons_pct"].items()))
    share = 100 * s["shared_excess"] / max(s["shared_wavefronts"], 1)
    print(f"shared-memory wavefronts {s['shared_wavefronts']:,}, of them bank-conflict excess "
          f"{s['shared_excess']:,} ({share:.0f}%)")
    for o in s["shared_by_opcode"][:8]:
        print(f"  {o['opcode']:10s} {o['wavefronts']:>14,} wavefronts, ideal {o['ideal']:>14,}, "
              f"excess {o['excess']:>14,}")
    print("store runs with the most excess (instruction index, stores, % of all excess):")
    for run in s["store_runs"][:12]:
        print(f"  {run['first']:5d}-{run['last']:5d}  {run['stores']:3d} stores  "
              f"{run['excess_pct']:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": kernel, **s}, f, indent=1)


if __name__ == "__main__":
    main()
