"""benchmarks/wkv7.py's `--shapes` argument: parsed shapes, and a one-line error for bad ones."""
from __future__ import annotations

import argparse

import pytest


def test_shapes_parse_and_bad_shapes_name_the_fix(benchmark_script):
    bench = benchmark_script("wkv7")
    assert bench.shape_list("2,4096,32,64;1,8192,64,64") == [(2, 4096, 32, 64), (1, 8192, 64, 64)]
    for bad in ("8,4096", "8,4096,12,x", "8,4096,12,0", "8,4096,12,64;"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not B,T,H,D .* e.g. "):
            bench.shape_list(bad)
