"""The chips a program is compiled for: their platform, peak FLOP/s, memory and bandwidth.

Every "which kernel runs", "does it fit" and "what MFU is that" decision reads the devices the
program is compiled for — the devices of its mesh — never `jax.default_backend()`: a CPU host
compiling for a TPU topology (`lwm-jax compile`) must take the TPU paths, and a process whose
default backend differs from its mesh's devices must not mix them up.

`platform_of(mesh)`: "tpu", "gpu" or "cpu" for a `Mesh`, a device or a list of devices
(None: JAX's default devices, what an unsharded program runs on).

`chip_spec(device)`: the `ChipSpec` of one device from `CHIPS`, matched on
`device.device_kind` (what JAX reports: "TPU v5 lite", "NVIDIA H100 80GB HBM3", ...), or None.
Figures are the vendors' published per-chip numbers: dense bf16 matrix FLOP/s (no sparsity),
HBM capacity and HBM bandwidth. They feed MFU and the roofline estimates of `lwm-jax compile`,
which are estimates, never measurements.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

import jax

GiB = 2**30
GB = 10**9

_PLATFORM_NAMES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One accelerator chip (one JAX device).

    name: short name ("v5p", "H100"); platform: "tpu" | "gpu";
    peak_flops: dense bf16 FLOP/s; hbm_bytes: memory one device holds (bytes);
    hbm_bytes_per_s: memory bandwidth (bytes/s).
    """

    name: str
    platform: str
    peak_flops: float
    hbm_bytes: int
    hbm_bytes_per_s: float


# Ordered: the first pattern that matches `device_kind` (lower case) wins, so the more specific
# names ("tpu v5 lite", "h100 pcie") come before the ones they contain ("tpu v5", "h100").
CHIPS: tuple[tuple[str, ChipSpec], ...] = (
    (r"tpu v4", ChipSpec("v4", "tpu", 275e12, 32 * GiB, 1228 * GB)),
    (r"tpu v5 ?lite|tpu v5e", ChipSpec("v5e", "tpu", 197e12, 16 * GiB, 819 * GB)),
    (r"tpu v5", ChipSpec("v5p", "tpu", 459e12, 95 * GiB, 2765 * GB)),
    (r"tpu v6 ?lite|tpu v6e|trillium", ChipSpec("v6e", "tpu", 918e12, 32 * GiB, 1640 * GB)),
    (r"a100.*40gb", ChipSpec("A100-40GB", "gpu", 312e12, 40 * GB, 1555 * GB)),
    (r"a100.*pcie", ChipSpec("A100-PCIe", "gpu", 312e12, 80 * GB, 1935 * GB)),
    (r"a100", ChipSpec("A100", "gpu", 312e12, 80 * GB, 2039 * GB)),
    (r"h100.*pcie", ChipSpec("H100-PCIe", "gpu", 756e12, 80 * GB, 2000 * GB)),
    (r"h100 nvl", ChipSpec("H100-NVL", "gpu", 835e12, 94 * GB, 3900 * GB)),
    (r"h100", ChipSpec("H100", "gpu", 989e12, 80 * GB, 3350 * GB)),
    (r"h200", ChipSpec("H200", "gpu", 989e12, 141 * GB, 4800 * GB)),
    (r"b200", ChipSpec("B200", "gpu", 2250e12, 180 * GB, 8000 * GB)),
)


def _devices(where: Any) -> list:
    if where is None:
        return list(jax.devices())
    if hasattr(where, "devices") and hasattr(where, "axis_names"):      # a Mesh
        return list(where.devices.flat)
    if isinstance(where, (list, tuple)):
        return list(where)
    return [where]


def platform_of(where: Any = None) -> str:
    """"tpu", "gpu" or "cpu": the platform of a mesh's (or device list's, or device's) devices;
    None = JAX's default devices. One-line ValueError for a mesh that mixes platforms."""
    names = {_PLATFORM_NAMES.get(d.platform, d.platform) for d in _devices(where)}
    if len(names) != 1:
        raise ValueError(f"devices of more than one platform in one mesh: {sorted(names)}")
    return names.pop()


def chip_spec(device: Any) -> ChipSpec | None:
    """The `ChipSpec` whose pattern matches `device.device_kind`; None for CPUs and unknown
    chips."""
    if _PLATFORM_NAMES.get(device.platform, device.platform) == "cpu":
        return None
    kind = str(device.device_kind).lower().strip()
    for pattern, spec in CHIPS:
        if re.search(pattern, kind):
            return spec
    return None


def peak_flops_per_device(device: Any | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device (default: JAX's first device); None when unknown."""
    spec = chip_spec(jax.devices()[0] if device is None else device)
    return spec.peak_flops if spec is not None else None


def skip_absent_tpu(environ=os.environ) -> bool:
    """On a host with libtpu installed but no TPU chip and no GPU (a CPU machine that compiles
    for TPU topologies, as CI does), have JAX use its CPU backend without first starting the TPU
    runtime, which fails there and writes a screen of C++ log lines to stderr before JAX falls
    back to the CPU anyway. Compiling for a TPU topology (`jax.experimental.topologies`) still
    works. Leaves an explicit `JAX_PLATFORMS` / `jax_platforms`, a TPU VM and a GPU host alone.
    Call before the first device use (the CLI and the test suite do). Returns whether it set
    the CPU backend."""
    if environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return False
    if importlib.util.find_spec("libtpu") is None:
        return False
    try:
        from jax._src import hardware_utils          # what JAX's own TPU start-up reads
        tpu_chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
        has_gpu = hardware_utils.has_visible_nvidia_gpu() or os.path.exists("/dev/kfd")
    except Exception:                                   # a JAX without these helpers: no change
        return False
    if tpu_chips or has_gpu:
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
