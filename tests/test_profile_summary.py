"""benchmarks/profile_summary.py on a synthetic device trace: kernel totals and how much
collective (NCCL) time no compute kernel overlaps."""
from __future__ import annotations

import gzip
import json
import os

import pytest


@pytest.fixture(scope="module")
def ps(benchmark_script):
    return benchmark_script("profile_summary")


def _write_trace(directory, kernels):
    """`kernels`: (pid, name, start_us, dur_us[, hlo_op]); pids 1, 2 are GPUs, 9 is the host."""
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (9, "/host:CPU"))]
    events = meta + [{"ph": "X", "pid": k[0], "tid": 0, "name": k[1], "ts": k[2], "dur": k[3],
                      "args": {"hlo_op": k[4]} if len(k) > 4 else {}} for k in kernels]
    path = os.path.join(directory, "plugins", "profile", "run", "perfetto_trace.json.gz")
    os.makedirs(os.path.dirname(path))
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"traceEvents": events}, f)


def test_exposed_collective_time_is_the_part_no_compute_kernel_overlaps(ps, tmp_path):
    _write_trace(str(tmp_path), [
        # GPU 0: gemm 0-100, fusion 150-200 (gap 100-150), all-reduce 80-180 on another stream:
        # overlapped by compute on 80-100 and 150-180, exposed on 100-150 (50 us)
        (1, "sm90_xmma_gemm_bf16", 0, 100), (1, "loop_fusion", 150, 50),
        (1, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 80, 100),
        # GPU 1: the collective fully inside compute, then idle, then a kernel
        (2, "wkv7_intra_bwd", 0, 300), (2, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100, 100),
        (2, "loop_fusion", 400, 100),
        (9, "host work is ignored", 0, 10_000),
    ])
    rows = {r["device"]: r for r in ps.communication(str(tmp_path))}
    assert rows["/device:GPU:0"] == {"device": "/device:GPU:0", "span": 0.2, "busy": 0.2,
                                     "collective": 0.1, "exposed_collective": 0.05, "idle": 0.0}
    assert rows["/device:GPU:1"] == {"device": "/device:GPU:1", "span": 0.5, "busy": 0.4,
                                     "collective": 0.1, "exposed_collective": 0.0, "idle": 0.1}
    kinds = {r["name"]: r["ms"] for r in ps.top_ops(str(tmp_path), None,
                                                     lambda e: ps._kind(e["name"]))}
    assert kinds["collectives"] == pytest.approx(0.2)
    assert kinds["gemm"] == pytest.approx(0.1)


def test_a_directory_without_a_trace_has_no_rows(ps, tmp_path):
    assert ps.communication(str(tmp_path)) == []


def test_exposed_time_is_told_per_collective_and_growth_per_op(ps, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    _write_trace(str(two), [
        # GPU 0: the head's all-reduce sits half under a gemm (exposed 40 us), the embedding's
        # after everything (exposed 60 us); GPU 1 is ignored (first device only)
        (1, "gemm_a", 0, 100, "dot.1"), (1, nccl, 60, 80, "all-reduce-start.7"),
        (1, "fusion_b", 140, 30, "fusion.2"), (1, nccl, 170, 60, "all-reduce-start.6"),
        (2, nccl, 0, 500, "all-reduce-start.7"),
    ])
    with open(two / "step.hlo.txt", "w", encoding="utf-8") as f:
        f.write('ENTRY %main (p: f32[]) -> f32[] {\n'
                '  %dot.1 = f32[] dot(), metadata={op_name="jit(step)/head/dot_general"}\n'
                '  %fusion.2 = f32[] fusion(), metadata={op_name="jit(step)/embed/scatter"}\n'
                '}\n')
    rows = {r["name"]: r for r in ps.exposed_collectives(str(two))}
    assert rows["all-reduce-start.6"]["ms"] == pytest.approx(0.06)
    assert rows["all-reduce-start.7"]["ms"] == pytest.approx(0.04)
    assert list(rows) == ["all-reduce-start.6", "all-reduce-start.7"]
    # the same ops on one device, the embedding's scatter 10 us faster
    _write_trace(str(one), [(1, "gemm_x", 0, 100, "dot.9"), (1, "fusion_y", 100, 20, "fusion.8")])
    with open(one / "step.hlo.txt", "w", encoding="utf-8") as f:
        f.write('ENTRY %main (p: f32[]) -> f32[] {\n'
                '  %dot.9 = f32[] dot(), metadata={op_name="jit(step)/head/dot_general"}\n'
                '  %fusion.8 = f32[] fusion(), metadata={op_name="jit(step)/embed/scatter"}\n'
                '}\n')
    grown = ps.compare(str(two), str(one))
    by_name = {r["name"]: (r["ms"], r["ms_against"]) for r in grown}
    # per device: the two-GPU trace's totals are halved (two device processes)
    assert by_name["embed/scatter"] == (pytest.approx(0.015), pytest.approx(0.02))
    assert by_name["head/dot_general"] == (pytest.approx(0.05), pytest.approx(0.1))
    assert grown[0]["name"] == nccl


def test_bandwidth_counts_each_fusion_parameters_and_results(ps, tmp_path):
    """Bytes per fusion from the HLO beside the trace (its computation's parameters + its
    results), so two 10 us kernels moving 12 MB each run at 1.2 TB/s; a tuple result long enough
    to carry `/*index=5*/` comments still opens its own computation; GEMMs are left out."""
    _write_trace(str(tmp_path), [
        (1, "loop_add_fusion", 0, 10, "fusion.1"), (1, "loop_add_fusion", 20, 10, "fusion.1"),
        (1, "loop_slice_fusion", 40, 4, "fusion.2"),
        (1, "gemm_fusion_dot", 50, 100, "gemm_fusion_dot.3"),
    ])
    six = ", ".join(["f32[10]"] * 5) + ", /*index=5*/f32[10]"
    with open(tmp_path / "step.hlo.txt", "w", encoding="utf-8") as f:
        f.write(
            "%fused_add (p0: f32[1000000], p1: f32[1000000]) -> f32[1000000] {\n"
            "  %p0 = f32[1000000]{0} parameter(0)\n"
            "  %p1 = f32[1000000]{0} parameter(1)\n"
            "  ROOT %add = f32[1000000]{0} add(%p0, %p1)\n"
            "}\n"
            f"%fused_slice (p: bf16[60]) -> ({six}) {{\n"
            "  %p = bf16[60]{0} parameter(0)\n"
            "}\n"
            "%fused_dot (a: bf16[64,64]) -> bf16[64,64] {\n"
            "  %a = bf16[64,64]{1,0} parameter(0)\n"
            "}\n"
            "ENTRY %main (x: f32[1000000]) -> f32[1000000] {\n"
            '  %fusion.1 = f32[1000000]{0} fusion(%x, %x), kind=kLoop, calls=%fused_add, '
            'metadata={op_name="jit(step)/time_mix/add"}\n'
            f'  %fusion.2 = ({six}) fusion(%y), kind=kLoop, calls=%fused_slice, '
            'metadata={op_name="jit(step)/slice"}\n'
            '  %gemm_fusion_dot.3 = bf16[64,64]{1,0} fusion(%z), kind=kCustom, '
            'calls=%fused_dot, metadata={op_name="jit(step)/dot_general"}\n'
            "}\n")
    assert ps.fusion_bytes(str(tmp_path)) == {"fusion.1": 12_000_000, "fusion.2": 360,
                                               "gemm_fusion_dot.3": 16384}
    rows = {r["name"]: r for r in ps.bandwidth(str(tmp_path), None, tb_s=3.0)}
    assert set(rows) == {"time_mix/add", "slice"}
    assert rows["time_mix/add"] == {"name": "time_mix/add", "ms": 0.02, "calls": 2,
                                    "gb": 0.024, "tb_s": 1.2, "floor_ms": 0.008}
    assert list(rows) == ["time_mix/add", "slice"]      # furthest above its floor first
