"""`benchmarks/longest_context.py`'s search: the largest multiple that fits, in few probes."""
import pytest


@pytest.fixture(scope="module")
def largest_fitting(benchmark_script):
    return benchmark_script("longest_context").largest_fitting


@pytest.mark.parametrize("limit", [1 << 20, (1 << 20) + 5 * 65536, 3_000_000, (1 << 23)])
def test_finds_the_largest_fitting_multiple(largest_fitting, limit):
    probes = []

    def fits(ctx):
        probes.append(ctx)
        return ctx <= limit
    best = largest_fitting(fits, 1 << 20, 1 << 23, 1 << 16)
    assert best == min(limit, 1 << 23) // (1 << 16) * (1 << 16)
    assert all(p % (1 << 16) == 0 for p in probes) and len(probes) <= 8   # 113 candidates


def test_none_when_the_smallest_does_not_fit(largest_fitting):
    assert largest_fitting(lambda ctx: False, 1024, 8192, 1024) is None
    assert largest_fitting(lambda ctx: True, 1000, 8191, 1024) == 7168    # multiples inside
