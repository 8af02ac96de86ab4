"""Which TTIR line each SASS instruction of a Triton kernel comes from, offline (no GPU needed).

    python3 benchmarks/wkv7.py ptxas --triton-site SITE --out DIR        # writes DIR/*.ttir
    python3 benchmarks/ttir_lines.py DIR/04_wkv7_intra_bwd_w4.ttir --triton-site SITE \\
        [--ops STS,LDS] [--warps 4] [--json F]

`wkv7.py ptxas` writes each kernel's Triton IR without source locations, so Triton's location for
every op is its own line in that file. This compiles the file for sm_90 with the Triton wheel
under SITE, assembles the PTX with `ptxas -lineinfo`, reads `nvdisasm -g`'s line annotations and
prints, for every TTIR line that issues one of `--ops` (opcode prefixes; default the
shared-memory stores and loads), the count per opcode, the line's op, and which `tt.dot` operand
the line's value is (lhs / rhs of the n-th product, through a `tt.trans` too): a run of 32 scalar
`STS` a thread on a product operand's line is a float32 64 x 64 tile staged in shared memory in
an order its registers do not hold it in (Nsight Compute on the device says how much those
stores conflict; `benchmarks/ncu_sass.py`). Counts are per thread, as the SASS listing is.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys

_LINE = re.compile(r'//## File "[^"]*", line (\d+)')
_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)")
_DEF = re.compile(r"^\s*(%[\w#]+)(?::\d+)? = ")
_DOT = re.compile(r"= tt\.dot (%[\w#]+), (%[\w#]+), (%[\w#]+)")
_TRANS = re.compile(r"= tt\.trans (%[\w#]+)")


def sass_by_line(listing: str) -> collections.Counter:
    """`nvdisasm -g` text -> Counter {(TTIR line or None, opcode): instructions}."""
    counts, line = collections.Counter(), None
    for text in listing.splitlines():
        m = _LINE.search(text)
        if m:
            line = int(m.group(1))
            continue
        m = _INSTR.match(text)
        if m:
            counts[(line, m.group(1))] += 1
    return counts


def dot_operands(ttir: str) -> dict[int, list[str]]:
    """TTIR text -> {line: ["lhs of dot 3", "rhs of dot 3 (transposed)", ...]} for the lines
    defining each `tt.dot`'s operands, followed through one `tt.trans`. Dots count from 1."""
    lines = ttir.splitlines()
    defs = {}
    for number, text in enumerate(lines, 1):
        m = _DEF.match(text)
        if m:
            defs[m.group(1)] = number
    roles = collections.defaultdict(list)
    n = 0
    for text in lines:
        m = _DOT.search(text)
        if not m:
            continue
        n += 1
        for side, value in (("lhs", m.group(1)), ("rhs", m.group(2))):
            number = defs.get(value)
            if number is None:
                continue
            t = _TRANS.search(lines[number - 1])
            if t and t.group(1) in defs:
                roles[number].append(f"{side} of dot {n} (transposed)")
                roles[defs[t.group(1)]].append(f"{side} of dot {n} (before its transpose)")
            else:
                roles[number].append(f"{side} of dot {n}")
    return dict(roles)


def attribute(counts: collections.Counter, ttir: str, ops: tuple[str, ...]) -> list[dict]:
    """One row per TTIR line issuing an opcode that starts with one of `ops`: line, {opcode:
    count}, the dot operand roles and the op's text (shortened)."""
    lines = ttir.splitlines()
    roles = dot_operands(ttir)
    per_line = collections.defaultdict(collections.Counter)
    for (line, opcode), c in counts.items():
        if opcode.startswith(ops):
            per_line[line][opcode] += c
    rows = []
    for line in sorted(per_line, key=lambda x: (x is None, x or 0)):
        text = lines[line - 1].strip() if line and line <= len(lines) else "?"
        op = re.sub(r"^%[\w#]+(?::\d+)? = ", "", text)
        rows.append({"line": line, "counts": dict(per_line[line]), "roles": roles.get(line, []),
                     "op": op[:90]})
    return rows


def _compile(path: str, site: str, warps: int) -> str:
    """Compile the TTIR at `path` for sm_90; return `nvdisasm -g`'s listing of the cubin."""
    sys.path.insert(0, site)
    import triton
    from triton.backends.compiler import GPUTarget
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 1})
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    base = os.path.splitext(path)[0] + ".lines"
    with open(base + ".ptx", "w") as f:
        f.write(kernel.asm["ptx"])
    subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-lineinfo", base + ".ptx",
                    "-o", base + ".cubin"], check=True)
    return subprocess.run([os.path.join(bindir, "nvdisasm"), "-g", "-c", base + ".cubin"],
                          capture_output=True, text=True, check=True).stdout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ttir", help="a .ttir written by `benchmarks/wkv7.py ptxas`")
    p.add_argument("--triton-site", required=True, help="folder holding the `triton` wheel")
    p.add_argument("--ops", default="STS,LDS", help="opcode prefixes, comma-separated")
    p.add_argument("--warps", type=int, default=None,
                   help="num_warps (default: the _wN in the file name, else 4)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if not os.path.isfile(args.ttir):
        raise SystemExit(f"ttir_lines: {args.ttir}: no such file; write it with "
                         "`benchmarks/wkv7.py ptxas --out DIR`")
    m = re.search(r"_w(\d+)\.ttir$", args.ttir)
    warps = args.warps or (int(m.group(1)) if m else 4)
    with open(args.ttir) as f:
        ttir = f.read()
    ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    counts = sass_by_line(_compile(args.ttir, args.triton_site, warps))
    rows = attribute(counts, ttir, ops)
    totals = collections.Counter()
    for (_, opcode), c in counts.items():
        if opcode.startswith(ops):
            totals[opcode] += c
    print(f"{sum(counts.values())} instructions a thread; " +
          ", ".join(f"{o} {c}" for o, c in totals.most_common()))
    for r in rows:
        counts_text = " ".join(f"{o} {c}" for o, c in sorted(r["counts"].items()))
        roles = f" [{'; '.join(r['roles'])}]" if r["roles"] else ""
        print(f"line {r['line']}: {counts_text}{roles} | {r['op']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"instructions": sum(counts.values()), "totals": dict(totals),
                       "lines": rows}, f, indent=1)


if __name__ == "__main__":
    main()
