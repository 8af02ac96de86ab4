"""benchmarks/ncu_sass.py on a synthetic Nsight Compute source page: the per-opcode mix, stall
shares, bank-conflict excess and the runs of conflicting stores."""
from __future__ import annotations

import csv

import pytest

_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)",
           "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
           "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "L1 Wavefronts Shared Excessive",
           "stall_mio", "stall_wait", "stall_barrier", "stall_mio (Not Issued)"]


@pytest.fixture(scope="module")
def ns(benchmark_script):
    return benchmark_script("ncu_sass")


def _write(path, instrs):
    """`instrs`: (source, samples, executed, wavefronts, ideal, excess, mio, wait, barrier)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "toy_kernel", ""])
        w.writerow(_HEADER)
        for i, (src, s, ex, wf, ideal, xs, mio, wait, bar) in enumerate(instrs):
            w.writerow([hex(0x100 + 16 * i), "      " + src, s, s, ex, wf, ideal, xs,
                        mio, wait, bar, mio])


def test_summary_counts_per_warp_shares_and_conflicting_store_runs(ns, tmp_path):
    path = str(tmp_path / "k.csv")
    rows = [("LDC R1, c[0x0][0x28]", 2, 4, 0, 0, 0, 0, 2, 0)]       # once per warp: 4 warps
    rows += [("STS [R3], R4", 5, 4, 40, 8, 32, 4, 1, 0)] * 3        # a run of conflicting stores
    rows += [("FADD R5, R5, R6", 1, 4, 0, 0, 0, 0, 1, 0)] * 20      # 20 apart: a new run below
    rows += [("@P0 STS.64 [R3+0x10], R4", 2, 4, 8, 4, 4, 2, 0, 0)]  # a smaller one
    rows += [("WARPGROUP.DEPBAR.LE gsb0, 0x0", 6, 4, 0, 0, 0, 0, 0, 6)]
    _write(path, rows)
    kernel, instrs = ns.read(path)
    assert kernel == "toy_kernel" and len(instrs) == len(rows)
    assert instrs[4]["opcode"] == "FADD"
    assert instrs[24]["opcode"] == "STS"                                  # the predicate skipped
    s = ns.summarize(instrs)
    assert s["executed_per_warp"] == len(rows)
    ops = {o["opcode"]: o for o in s["opcodes"]}
    total = 2 + 15 + 20 + 2 + 6
    assert ops["STS"]["per_warp"] == 4 and ops["STS"]["sample_pct"] == round(100 * 17 / total, 1)
    assert s["opcodes"][0]["opcode"] == "FADD"                              # most samples first
    assert ops["WARPGROUP"]["reasons_pct"] == {"barrier": round(100 * 6 / total, 1)}
    # the "(Not Issued)" column is not counted again
    assert s["stall_reasons_pct"]["mio"] == round(100 * 14 / total, 1)
    assert s["shared_wavefronts"] == 128 and s["shared_excess"] == 100
    runs = s["store_runs"]
    assert [(r["first"], r["last"], r["stores"], r["excess"]) for r in runs] == \
        [(1, 3, 3, 96), (24, 24, 1, 4)]
    assert runs[0]["excess_pct"] == 96.0


def test_a_file_without_the_source_page_is_one_clear_error(ns, tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"Section Name","Metric Name"\n"Speed Of Light","Duration"\n')
    with pytest.raises(SystemExit, match="no 'Source' column; export it with"):
        ns.read(str(path))
