"""Top device ops of a `jax.profiler.trace(..., create_perfetto_trace=True)` directory.

    python benchmarks/profile_summary.py $OUT/prof/0.1b-bf16-mixed [--n 25] [--json F]

Reads the newest `perfetto_trace.json.gz` under the directory, keeps the complete events of the
accelerator processes (`/device:GPU:*`, `/device:TPU:*`: one event per kernel launch), and sums
their durations by kernel name, by kind (WKV kernels, GEMMs, other XLA fusions, copies) and by
the model's `jax.named_scope` (the innermost of `SCOPES` found in the event's HLO op metadata;
backward ops keep their forward scope inside `transpose(...)`). Needs nothing beyond the
standard library, so it runs where the trace was taken.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def _newest_trace(directory: str) -> str | None:
    found = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


# innermost first: an op inside `wkv` is also inside `time_mix`
SCOPES = ("wkv", "time_mix", "channel_mix", "attention", "mlp", "head", "loss", "optimizer")
KINDS = (("wkv kernels", ("wkv7_",)), ("copies", ("memcpy", "copy")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "dot")),
         ("other fusions", ("fusion",)))


def _device_events(directory: str) -> list[dict]:
    path = _newest_trace(directory)
    if path is None:
        return []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    device_pids = {e["pid"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"
                   and any(k in str((e.get("args") or {}).get("name", ""))
                           for k in ("/device:GPU", "/device:TPU"))}
    return [e for e in events
            if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]


def _ranked(total_us: dict, calls: dict, n: int | None) -> list[dict]:
    grand = sum(total_us.values()) or 1.0
    ranked = sorted(total_us.items(), key=lambda kv: -kv[1])[:n]
    return [{"name": name[:120], "ms": round(us / 1e3, 3), "calls": calls[name],
             "pct": round(100 * us / grand, 1)} for name, us in ranked]


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def _scope(event: dict) -> str:
    text = " ".join(str(v) for v in (event.get("args") or {}).values())
    found = [s for s in SCOPES if f"/{s}/" in text or f"({s})" in text or f"{s}/" in text]
    return found[0] if found else "(no scope)"


def top_ops(directory: str, n: int = 20, key=lambda e: e["name"]) -> list[dict]:
    """`[{"name", "ms", "calls", "pct"}]` for the `n` device ops with the most total time
    (ms summed over the whole trace; `pct` of all device-op time; None = all). `key` groups
    events (default: the kernel name). Empty without a device trace."""
    total_us: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in _device_events(directory):
        total_us[key(e)] += float(e["dur"])
        calls[key(e)] += 1
    return _ranked(total_us, calls, n)


def summary(directory: str, n: int = 40) -> dict:
    """Top `n` kernels, time by kind and by named scope, and three sample events' metadata."""
    events = _device_events(directory)
    return {"top": top_ops(directory, n),
            "by_kind": top_ops(directory, None, lambda e: _kind(e["name"])),
            "by_scope": top_ops(directory, None, _scope),
            "sample_args": [e.get("args") for e in events[:3]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--n", type=int, default=25)
    ap.add_argument("--json", default=None, help="also write the full summary here")
    args = ap.parse_args()
    result = summary(args.directory, args.n)
    for title in ("top", "by_kind", "by_scope"):
        print(f"-- {title}")
        for row in result[title]:
            print(f"{row['ms']:10.3f} ms {row['pct']:5.1f}% {row['calls']:6d}x  {row['name']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
