"""Top device ops of a `jax.profiler.trace(..., create_perfetto_trace=True)` directory.

    python benchmarks/profile_summary.py $OUT/prof/0.1b-bf16-mixed [--n 25] [--json F] [--against DIR]

Reads the newest `perfetto_trace.json.gz` under the directory, keeps the complete events of the
accelerator processes (`/device:GPU:*`, `/device:TPU:*`: one event per kernel launch), and sums
their durations by kernel name, by kind (WKV kernels, GEMMs, other XLA fusions, copies) and by
the model's `jax.named_scope` (the innermost of `SCOPES` found in the event's HLO op metadata;
backward ops keep their forward scope inside `transpose(...)`); per device, how much collective
(NCCL) time no compute kernel overlaps (`communication`) and which collectives that time
belongs to (`exposed_collectives`); which fusions run furthest above their bandwidth floor
(`bandwidth`: bytes from the HLO beside the trace); with `--against DIR`, the op paths whose
per-device time grew most from DIR's trace (`compare`: e.g. a 2-GPU step against the 1-GPU
one). Needs nothing beyond the standard library, so it runs where the trace was taken.
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


def _computation(line: str) -> str | None:
    """The name a computation's header line opens (`%fused_x (p: f32[4]) -> f32[4] {`), else
    None. Instructions have ` = ` before any `{`; `/*index=5*/` comments in long tuple types
    do not count."""
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and "=" not in re.sub(r"/\*.*?\*/", "", line).split("{")[0]:
        return head.group(1)
    return None


def _instructions(directory: str):
    """`(computation, instruction name, line)` for each instruction of `HLO_FILE` in
    `directory` (nothing when absent)."""
    path = os.path.join(directory, HLO_FILE)
    if not os.path.exists(path):
        return
    computation = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if (head := _computation(line)) is not None:
                computation = head
            elif m := _INSTR.match(line):
                yield computation, m.group(1), line


def op_names(directory: str) -> dict[str, str]:
    """HLO instruction name -> its `op_name` metadata (the jax op path, named scopes included),
    from `HLO_FILE` in `directory` (empty when absent). A fusion without metadata of its own
    takes the first op_name inside the computation it calls."""
    names, calls, first_in = {}, {}, {}
    for computation, instr, line in _instructions(directory):
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


_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += _ELEMENT_BYTES[dtype] * count
    return total


def fusion_bytes(directory: str) -> dict[str, int]:
    """HLO fusion name -> the bytes it reads and writes once: its called computation's
    parameters plus its result, from `HLO_FILE` (empty when absent). An upper bound on what
    the kernel must move (a parameter it slices counts whole) and a lower bound on what it
    may move (re-reads are not counted)."""
    params: dict[str, int] = collections.defaultdict(int)
    fusions: dict[str, tuple[int, str]] = {}
    for computation, instr, line in _instructions(directory):
        rhs = line.split(" = ", 1)[1]
        if " parameter(" in rhs:
            params[computation] += _shape_bytes(rhs.split(" parameter(")[0])
        elif " fusion(" in rhs and (called := _CALLS.search(line)):
            fusions[instr] = (_shape_bytes(rhs.split(" fusion(")[0]), called.group(1))
    return {name: out + params.get(called, 0) for name, (out, called) in fusions.items()}


def bandwidth(directory: str, n: int | None = 25, tb_s: float = 3.0) -> list[dict]:
    """The fusion kernels grouped by jax op path, those furthest above their bandwidth floor
    first: `[{"name", "ms", "calls", "gb", "tb_s", "floor_ms"}]` (ms and GB over the whole
    trace; `tb_s` the rate achieved; `floor_ms` the time at `tb_s` TB/s, e.g. 3.0 for an H100's
    HBM3). Kernels without an HLO fusion (GEMM libraries, Pallas calls) are left out. Says
    which elementwise work is slow, as opposed to merely plentiful."""
    sizes = fusion_bytes(directory)
    names = op_names(directory)
    us: dict[str, float] = collections.defaultdict(float)
    moved: dict[str, int] = collections.defaultdict(int)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in _device_events(directory):
        hlo = str((e.get("args") or {}).get("hlo_op", ""))
        if hlo not in sizes or _kind(e["name"]) == "gemm":
            continue
        key = _op_path(e, names)
        us[key] += float(e["dur"])
        moved[key] += sizes[hlo]
        calls[key] += 1
    rows = [{"name": k[:120], "ms": round(us[k] / 1e3, 3), "calls": calls[k],
             "gb": round(moved[k] / 1e9, 3),
             "tb_s": round(moved[k] / (us[k] * 1e-6) / 1e12, 2) if us[k] else 0.0,
             "floor_ms": round(moved[k] / (tb_s * 1e12) * 1e3, 3)} for k in us]
    return sorted(rows, key=lambda r: r["floor_ms"] - r["ms"])[:n]


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
            "bandwidth": bandwidth(directory, n),
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
    print("-- fusions furthest above the bandwidth floor (3.0 TB/s; ms, GB over the trace)")
    for row in result["bandwidth"]:
        print(f"{row['ms']:10.3f} ms {row['floor_ms']:8.3f} floor {row['gb']:8.2f} GB "
              f"{row['tb_s']:5.2f} TB/s {row['calls']:6d}x  {row['name']}")
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
