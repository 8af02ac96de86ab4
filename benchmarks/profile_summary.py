"""Top device ops of a `jax.profiler.trace(..., create_perfetto_trace=True)` directory.

    python benchmarks/profile_summary.py $OUT/prof/0.1b-bf16-mixed [--n 25]

Reads the newest `perfetto_trace.json.gz` under the directory, keeps the complete events of the
accelerator processes (`/device:GPU:*`, `/device:TPU:*`: one event per kernel launch), and sums
their durations by kernel name. Needs nothing beyond the standard library, so it runs where the
trace was taken.
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


def top_ops(directory: str, n: int = 20) -> list[dict]:
    """`[{"name", "ms", "calls", "pct"}]` for the `n` device ops with the most total time
    (ms summed over the whole trace; `pct` of all device-op time). Empty without a device trace."""
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
    total_us: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e:
            total_us[e["name"]] += float(e["dur"])
            calls[e["name"]] += 1
    grand = sum(total_us.values()) or 1.0
    ranked = sorted(total_us.items(), key=lambda kv: -kv[1])[:n]
    return [{"name": name[:120], "ms": round(us / 1e3, 3), "calls": calls[name],
             "pct": round(100 * us / grand, 1)} for name, us in ranked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--n", type=int, default=25)
    args = ap.parse_args()
    for row in top_ops(args.directory, args.n):
        print(f"{row['ms']:10.3f} ms {row['pct']:5.1f}% {row['calls']:6d}x  {row['name']}")


if __name__ == "__main__":
    main()
