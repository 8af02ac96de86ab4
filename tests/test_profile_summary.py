"""benchmarks/profile_summary.py on a synthetic device trace: kernel totals and how much
collective (NCCL) time no compute kernel overlaps."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "profile_summary.py")


@pytest.fixture(scope="module")
def ps():
    spec = importlib.util.spec_from_file_location("profile_summary", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_trace(directory, kernels):
    """`kernels`: (pid, name, start_us, dur_us); pids 1, 2 are GPUs, 9 is the host."""
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (9, "/host:CPU"))]
    events = meta + [{"ph": "X", "pid": pid, "tid": 0, "name": name, "ts": ts, "dur": dur}
                     for pid, name, ts, dur in kernels]
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
