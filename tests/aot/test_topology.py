"""TPU topology names -> chip grids and the compile-only devices libtpu describes for them
(`lwm_jax.aot.topology`), and the chip table behind MFU and the fit check (`lwm_jax.hardware`)."""
import pytest

from lwm_jax.aot.topology import parse_topology, topology_devices
from lwm_jax.hardware import chip_spec, peak_flops_per_device, platform_of


@pytest.mark.parametrize("name,grid,jax_name,cloud", [
    ("v4-8", (2, 2, 1), "v4:2x2x1", "v4-8"),            # v4-N / v5p-N count TensorCores
    ("v4-32", (2, 2, 4), "v4:2x2x4", "v4-32"),
    ("v5p-128", (4, 4, 4), "v5p:4x4x4", "v5p-128"),
    ("v5p-1024", (8, 8, 8), "v5p:8x8x8", "v5p-1024"),
    ("v5litepod-1", (1, 1), "v5e:1x1", "v5litepod-1"),   # v5e / v6e count chips
    ("v5litepod-16", (4, 4), "v5e:4x4", "v5litepod-16"),
    ("v6e-8", (2, 4), "v6e:2x4", "v6e-8"),
    ("v6e-64", (8, 8), "v6e:8x8", "v6e-64"),
    ("v5p:4x4x4", (4, 4, 4), "v5p:4x4x4", "v5p-128"),    # JAX's own form
    ("v5e:2x2", (2, 2), "v5e:2x2", "v5litepod-4"),
])
def test_names_give_the_standard_slice_shapes(name, grid, jax_name, cloud):
    topo = parse_topology(name)
    assert topo.grid == grid and topo.jax_name == jax_name and topo.cloud_name == cloud


@pytest.mark.parametrize("name,match", [
    ("v5e-16", r"for v5e write v5litepod-16"),
    ("v4-12", r"multiple of 8"),
    ("v6e-12", r"not a standard v6e slice shape; give the chip grid in JAX's form"),
    ("v9:2x2", r"unknown TPU generation 'v9'"),
    ("v5p:2x2", r"3-D grid"),
    ("", r"not a TPU topology"),
    ("tpu", r"not a TPU topology"),
])
def test_bad_names_are_one_line_errors(name, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_topology(name)
    assert "\n" not in str(err.value) and str(err.value).startswith("--topology: ")


@pytest.mark.tpu_compile
@pytest.mark.parametrize("name,kind,chips", [
    ("v4-32", "TPU v4", 16),            # megacore: one device per chip, not per TensorCore
    ("v5p-16", "TPU v5", 8),
    ("v5litepod-8", "TPU v5 lite", 8),  # one host of 8 chips
    ("v6e-16", "TPU v6 lite", 16),
    ("v5litepod-1", "TPU v5 lite", 1),
])
def test_libtpu_describes_one_device_per_chip_on_a_cpu_host(name, kind, chips):
    devices = topology_devices(name)
    assert len(devices) == chips and {d.device_kind for d in devices} == {kind}
    assert platform_of(devices) == "tpu" and platform_of() == "cpu"
    spec = chip_spec(devices[0])
    assert spec is not None and spec.platform == "tpu" and spec.hbm_bytes >= 16 * 2**30


@pytest.mark.tpu_compile
def test_slices_carry_their_index():
    devices = topology_devices("v5litepod-16", num_slices=2)
    assert len(devices) == 32 and sorted({d.slice_index for d in devices}) == [0, 1]
    with pytest.raises(ValueError, match=r"--num-slices: must be an integer >= 1"):
        topology_devices("v5litepod-16", num_slices=0)


class _Device:
    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


@pytest.mark.parametrize("kind,name,tflops", [
    ("TPU v4", "v4", 275), ("TPU v5 lite", "v5e", 197), ("TPU v5", "v5p", 459),
    ("TPU v5p", "v5p", 459), ("TPU v6 lite", "v6e", 918),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB", 312), ("NVIDIA A100-SXM4-80GB", "A100", 312),
    ("NVIDIA H100 80GB HBM3", "H100", 989), ("NVIDIA H200", "H200", 989),
    ("NVIDIA B200", "B200", 2250),
])
def test_every_documented_chip_has_a_peak_so_mfu_is_never_null(kind, name, tflops):
    platform = "tpu" if kind.startswith("TPU") else "gpu"
    spec = chip_spec(_Device(platform, kind))
    assert spec.name == name and spec.peak_flops == tflops * 1e12
    assert peak_flops_per_device(_Device(platform, kind)) == tflops * 1e12
    assert chip_spec(_Device("cpu", "cpu")) is None
    assert chip_spec(_Device("gpu", "NVIDIA GeForce GTX 1080")) is None
