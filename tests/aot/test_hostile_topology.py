"""Hostile `--topology` / `--num-slices` values are one-line ValueErrors naming the flag, never a
libtpu runtime error or abort (`lwm_jax.aot.topology`)."""
import importlib.util

import pytest

from lwm_jax.aot import topology as topo_mod
from lwm_jax.aot.topology import MAX_CHIPS, parse_topology, topology_devices


@pytest.mark.parametrize("name", ["v4:4096x4096x4096", "v5e:1000000x1000000",
                                  f"v5litepod-{2 * MAX_CHIPS}", f"v5p-{4 * MAX_CHIPS + 8}"])
def test_a_grid_larger_than_any_slice_is_refused(name):
    with pytest.raises(ValueError, match=r"^--topology: .*more than any TPU slice"):
        parse_topology(name)


def test_too_many_slices_is_refused_before_libtpu():
    with pytest.raises(ValueError, match=r"^--num-slices: 4294967296 is more than 1024"):
        topology_devices("v4-8", 4294967296)


def test_a_runtime_error_of_libtpu_names_the_flag(monkeypatch):
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs libtpu")
    from jax.experimental import topologies

    def fail(**kwargs):
        raise RuntimeError("INVALID_ARGUMENT: bad topology\nsecond line")
    monkeypatch.setattr(topologies, "get_topology_desc", fail)
    with pytest.raises(ValueError, match=r"^--topology: libtpu cannot describe 'v4:2x2x2'") \
            as err:
        topology_devices("v4:2x2x2")
    assert "\n" not in str(err.value)
