"""Top device ops of a `jax.profiler.trace(..., create_perfetto_trace=True)` directory.

    python benchmarks/profile_summary.py $OUT/prof/0.1b-bf16-mixed [--n 25] [--json F] [--against DIR]

Reads the newest `perfetto_trace.json.gz` under the directory, keeps the complete events of the
accelerator processes (`/device:GPU:*`, `/device:TPU:*`: one event per kernel launch), and sums
their durations by kernel name, by kind (WKV kernels, GEMMs, other XLA fusions, copies) and by
the model's `jax.named_scope` (the innermost of `SCOPES` found in the event's HLO op metadata;
backward ops keep their forward scope inside `transpose(...)`); per device, how much collective
(NCCL) time no compute kernel overlaps (`communication`) and which collectives that time
belongs to (`exposed_collectives`); with `--against DIR`, the op paths whose per-device time
grew most from DIR's trace (`compare`: e.g. a 2-GPU step against the 1-GPU one). Needs nothing beyond the
standard library, so it runs where the trace was taken.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re


def _newest_trace(directory: str) -> str | None:
    found = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
    return max(found, key=os.path.getmtime) if found else None


# innermost first: an op inside `wkv` is also inside `time_mix`
SCOPES = ("wkv", "time_mix", "channel_mix", "attention", "mlp", "block_norm", "embed", "head",
          "loss", "optimizer")
COLLECTIVE_KEYS = ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather", "allgather",
                   "reduce-scatter", "reducescatter", "all-to-all", "collective-permute")
KINDS = (("collectives", COLLECTIVE_KEYS), ("wkv kernels", ("wkv7_",)),
         ("copies", ("memcpy", "copy")),
         ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "dot")),
         ("other fusions", ("fusion",)))


def _device_trace(directory: str) -> tuple[list[dict], dict]:
    """Complete events of the device processes, and `{pid: process name}` of those processes."""
    path = _newest_trace(directory)
    events: list = []
    if path is not None:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
        events = data["traceEvents"] if isinstance(data, dict) else data
    devices = {e["pid"]: str((e.get("args") or {}).get("name", "")) for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"
               and any(k in str((e.get("args") or {}).get("name", ""))
                       for k in ("/device:GPU", "/device:TPU"))}
    kept = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e]
    return kept, devices


def _device_events(directory: str) -> list[dict]:
    return _device_trace(directory)[0]


def _ranked(total_us: dict, calls: dict, n: int | None) -> list[dict]:
    grand = sum(total_us.values()) or 1.0
    ranked = sorted(total_us.items(), key=lambda kv: -kv[1])[:n]
    return [{"name": name[:120], "ms": round(us / 1e3, 3), "calls": calls[name],
             "pct": round(100 * us / grand, 1)} for name, us in ranked]


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


HLO_FILE = "step.hlo.txt"      # the compiled step's HLO text, written beside the trace
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_names(directory: str) -> dict[str, str]:
    """HLO instruction name -> its `op_name` metadata (the jax op path, named scopes included),
    from `HLO_FILE` in `directory` (empty when absent). A fusion without metadata of its own
    takes the first op_name inside the computation it calls."""
    path = os.path.join(directory, HLO_FILE)
    if not os.path.exists(path):
        return {}
    names, calls, first_in = {}, {}, {}
    computation = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if head and "=" not in line.split("{")[0]:
                computation = head.group(1)
                continue
            m = _INSTR.match(line)
            if not m:
                continue
            instr = m.group(1)
            called, op_name = _CALLS.search(line), _OP_NAME.search(line)
            called, op_name = called and called.group(1), op_name and op_name.group(1)
            if op_name:
                names[instr] = op_name
                first_in.setdefault(computation, op_name)
            elif called:
                calls[instr] = called
    for instr, called in calls.items():
        if called in first_in:
            names.setdefault(instr, first_in[called])
    return names


def _op_text(event: dict, names: dict[str, str]) -> str:
    args = event.get("args") or {}
    return names.get(str(args.get("hlo_op", "")), "") or " ".join(map(str, args.values()))


def _scope(event: dict, names: dict[str, str]) -> str:
    text = _op_text(event, names)
    found = [s for s in SCOPES if f"/{s}/" in text or f"({s})" in text or f"{s}/" in text]
    return found[0] if found else "(no scope)"


def _op_path(event: dict, names: dict[str, str]) -> str:
    """The op path without the `jit(...)` prefixes (`transpose(jvp(time_mix))/mul`), or the
    kernel name when the op is unknown."""
    text = names.get(str((event.get("args") or {}).get("hlo_op", "")), "")
    return re.sub(r"^(jit\([^)]*\)/)+", "", text) if text else event["name"]


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


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged `(start, end)` intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def communication(directory: str) -> list[dict]:
    """Per device: how much of its collective kernels' time (NCCL, all-reduce, ...) no other
    kernel of the same device overlaps. Fields (ms over the whole trace): `span` (first kernel
    start to last kernel end), `busy` (any kernel running), `collective` (any collective
    running), `exposed_collective` (a collective running and no compute kernel), `idle`
    (span - busy). Exposed collective time is what overlapping communication could still win."""
    events, devices = _device_trace(directory)
    rows = []
    for pid, name in sorted(devices.items(), key=lambda kv: kv[1]):
        mine = [e for e in events if e["pid"] == pid]
        if not mine:
            continue
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in mine]
        is_coll = [any(k in e["name"].lower() for k in COLLECTIVE_KEYS) for e in mine]
        coll = _union([sp for sp, c in zip(spans, is_coll) if c])
        comp = _union([sp for sp, c in zip(spans, is_coll) if not c])
        busy = _union(spans)
        span = max(b for _, b in spans) - min(a for a, _ in spans)
        ms = lambda us: round(us / 1e3, 3)  # noqa: E731
        rows.append({"device": name, "span": ms(span), "busy": ms(_length(busy)),
                     "collective": ms(_length(coll)),
                     "exposed_collective": ms(_length(_subtract(coll, comp))),
                     "idle": ms(span - _length(busy))})
    return rows


def _subtract(xs, ys) -> list[tuple[float, float]]:
    """Parts of the merged intervals `xs` that the merged intervals `ys` do not cover."""
    out, j = [], 0
    for lo, hi in xs:
        while j < len(ys) and ys[j][1] <= lo:
            j += 1
        k, cur = j, lo
        while k < len(ys) and ys[k][0] < hi:
            if ys[k][0] > cur:
                out.append((cur, ys[k][0]))
            cur = max(cur, ys[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def exposed_collectives(directory: str, n: int | None = 10) -> list[dict]:
    """The collectives whose time no compute kernel overlaps, on the first device, most exposed
    first: `[{"name", "ms", "calls", "pct"}]` (name: the collective's HLO op path, or its
    kernel name; ms over the whole trace; pct of all exposed time). Says which gradient's
    reduction to move or shrink."""
    events, devices = _device_trace(directory)
    if not devices:
        return []
    first = min(devices, key=lambda pid: devices[pid])
    mine = [e for e in events if e["pid"] == first]
    names = op_names(directory)
    is_coll = lambda e: any(k in e["name"].lower() for k in COLLECTIVE_KEYS)  # noqa: E731
    comp = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                   for e in mine if not is_coll(e)])
    total_us: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in mine:
        if is_coll(e):
            start = float(e["ts"])
            bare = _subtract([(start, start + float(e["dur"]))], comp)
            hlo = str((e.get("args") or {}).get("hlo_op", ""))
            path = _op_path(e, names) if hlo in names else ""
            key = f"{hlo} {path}".strip() if hlo else e["name"]
            total_us[key] += _length(bare)
            calls[key] += 1
    return _ranked(total_us, calls, n)


def compare(directory: str, against: str, n: int = 25) -> list[dict]:
    """Per-device time by jax op path in `directory` minus that in `against` (e.g. the 2-GPU
    step against the 1-GPU one), largest growth first: `[{"name", "ms", "ms_against"}]`.
    Both traces should cover the same number of steps; each total is divided by the number
    of devices with kernels in its trace. Op paths, unlike fusion names, match across
    programs."""
    def per_device(d):
        events = _device_events(d)
        names = op_names(d)
        n_devices = max(len({e["pid"] for e in events}), 1)     # devices with kernels
        totals: dict[str, float] = collections.defaultdict(float)
        for e in events:
            totals[_op_path(e, names)] += float(e["dur"]) / n_devices
        return totals
    mine, theirs = per_device(directory), per_device(against)
    keys = sorted(set(mine) | set(theirs), key=lambda k: -(mine.get(k, 0) - theirs.get(k, 0)))
    return [{"name": k[:120], "ms": round(mine.get(k, 0) / 1e3, 3),
             "ms_against": round(theirs.get(k, 0) / 1e3, 3)} for k in keys[:n]]


def summary(directory: str, n: int = 40) -> dict:
    """Top `n` kernels, time by kind, by named scope and (with `HLO_FILE`) by jax op path,
    and three sample events' metadata."""
    events = _device_events(directory)
    names = op_names(directory)
    return {"top": top_ops(directory, n),
            "by_kind": top_ops(directory, None, lambda e: _kind(e["name"])),
            "by_scope": top_ops(directory, None, lambda e: _scope(e, names)),
            "by_op": top_ops(directory, n, lambda e: _op_path(e, names)) if names else [],
            "communication": communication(directory),
            "exposed_collectives": exposed_collectives(directory, n),
            "sample_args": [e.get("args") for e in events[:3]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--n", type=int, default=25)
    ap.add_argument("--json", default=None, help="also write the full summary here")
    ap.add_argument("--against", default=None, metavar="DIR",
                    help="also list the op paths whose per-device time grew most from DIR's "
                         "trace to this one")
    args = ap.parse_args()
    result = summary(args.directory, args.n)
    for title in ("top", "by_kind", "by_scope", "by_op", "exposed_collectives"):
        print(f"-- {title}")
        for row in result[title]:
            print(f"{row['ms']:10.3f} ms {row['pct']:5.1f}% {row['calls']:6d}x  {row['name']}")
    print("-- communication (ms over the trace)")
    for row in result["communication"]:
        print(json.dumps(row))
    if args.against:
        print(f"-- per device, this trace minus {args.against} (ms)")
        for row in compare(args.directory, args.against, args.n):
            print(f"{row['ms'] - row['ms_against']:+10.3f} ms {row['ms']:10.3f} "
                  f"{row['ms_against']:10.3f}  {row['name']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
