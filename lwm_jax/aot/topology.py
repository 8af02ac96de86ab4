"""TPU topologies by name, as devices a CPU host can compile for (libtpu, no TPU attached).

Names accepted (`parse_topology`):
- Cloud accelerator types, as `gcloud` and `tpu_scripts` take them: `v4-N` and `v5p-N` count
  TensorCores (two per chip; JAX runs both as one device, "megacore"), `v5litepod-N` (v5e) and
  `v6e-N` count chips. The chip grid is the slice's standard shape: v4 / v5p chips form a 3-D
  torus grown from 2x2x1 (v5p-128 = 64 chips = 4x4x4), v5e / v6e a 2-D one (v6e-64 = 8x8).
- JAX's form `GENERATION:AxBxC` (`v5p:4x4x4`, `v5e:4x4`, `v4:2x2x4`): the chip grid itself.

`topology_devices(name, num_slices)` returns the compile-only devices of that topology
(`jax.experimental.topologies.get_topology_desc`); with `num_slices` > 1 each device carries its
`slice_index` and `lwm_jax.train.sharding.make_mesh` lays the `data` axis across the slices.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

# generation -> (JAX's name for it, grid rank, Cloud name's size counts TensorCores)
GENERATIONS = {
    "v4": ("v4", 3, True),
    "v5p": ("v5p", 3, True),
    "v5litepod": ("v5e", 2, False),
    "v6e": ("v6e", 2, False),
}
_JAX_TO_CLOUD = {"v4": "v4", "v5p": "v5p", "v5e": "v5litepod", "v6e": "v6e"}
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "v6": "v6e", "v5": "v5p"}


@dataclasses.dataclass(frozen=True)
class Topology:
    """One TPU slice. `name`: as given; `generation`: Cloud's (v4, v5p, v5litepod, v6e);
    `grid`: chips along each torus axis; `jax_name`: the `get_topology_desc` name."""

    name: str
    generation: str
    grid: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.grid)

    @property
    def jax_name(self) -> str:
        return f"{GENERATIONS[self.generation][0]}:{'x'.join(map(str, self.grid))}"

    @property
    def host_bounds(self) -> tuple[int, int, int]:
        """Chips per host along each axis: a v5e / v6e slice of at most 8 chips is one host
        (as is a v4 / v5p slice under 4 chips); every larger slice has 2x2x1 per host."""
        rank2 = GENERATIONS[self.generation][1] == 2
        if (rank2 and self.chips <= 8) or (not rank2 and self.chips < 4):
            return (*self.grid, 1) if rank2 else self.grid
        return (2, 2, 1)

    @property
    def cloud_name(self) -> str:
        cores = GENERATIONS[self.generation][2]
        return f"{self.generation}-{self.chips * 2 if cores else self.chips}"


def _grid(chips: int, rank: int) -> tuple[int, ...] | None:
    """The standard slice shape of `chips` chips: grown from 2x2(x1) by doubling the smallest
    axis (the last of equals first), so 16 -> 2x2x4 / 4x4 and 64 -> 4x4x4 / 8x8; None for a
    count no such shape has."""
    if rank == 2 and chips == 1:
        return (1, 1)
    dims = [2, 2] + [1] * (rank - 2)
    while math.prod(dims) < chips:
        i = max(j for j in range(rank) if dims[j] == min(dims))
        dims[i] *= 2
    return tuple(dims) if math.prod(dims) == chips else None


# The most chips a topology may name (above the largest real slice of any generation: v5p's
# 8960, v4's 4096) and the most slices `--num-slices` takes; libtpu fails or aborts beyond.
MAX_CHIPS = 16384
MAX_SLICES = 1024


def _bounded(topo: "Topology") -> "Topology":
    if topo.chips > MAX_CHIPS:
        raise ValueError(f"--topology: {topo.name!r:.60} has {topo.chips} chips, more than any "
                         f"TPU slice (at most {MAX_CHIPS}); e.g. v4-32, v5p-128 or v5p:4x4x4")
    return topo


def parse_topology(text: str) -> Topology:
    """A `Topology` from a Cloud accelerator type or JAX's `GEN:AxB[xC]` form; ValueError (one
    line naming `--topology` and the accepted forms) for anything else."""
    where = "--topology"
    forms = "e.g. v4-32, v5p-128, v5litepod-16, v6e-64 or v5p:4x4x4"
    text = (text or "").strip()
    m = re.fullmatch(r"([a-z0-9]+):([0-9]+(?:x[0-9]+){1,2})", text)
    if m:
        gen = _JAX_TO_CLOUD.get(m.group(1))
        grid = tuple(int(x) for x in m.group(2).split("x"))
        if gen is None:
            raise ValueError(f"{where}: unknown TPU generation {m.group(1)!r} in {text!r}; "
                             f"known: {', '.join(_JAX_TO_CLOUD)} ({forms})")
        rank = GENERATIONS[gen][1]
        if len(grid) != rank or min(grid) < 1:
            raise ValueError(f"{where}: {text!r}: {m.group(1)} chips form a {rank}-D grid; "
                             f"write {rank} sizes such as {m.group(1)}:" +
                             "x".join(["2"] * rank))
        return _bounded(Topology(text, gen, grid))
    m = re.fullmatch(r"([a-z0-9]+)-([0-9]+)", text)
    if not m:
        raise ValueError(f"{where}: {text!r:.60} is not a TPU topology; {forms}")
    gen, size = m.group(1), int(m.group(2))
    if gen not in GENERATIONS:
        hint = f"; for {gen} write {_ALIASES[gen]}-{size}" if gen in _ALIASES else ""
        raise ValueError(f"{where}: unknown TPU generation {gen!r} in {text!r}; known: "
                         f"{', '.join(GENERATIONS)}{hint}")
    _, rank, counts_cores = GENERATIONS[gen]
    if counts_cores and (size < 8 or size % 8):
        raise ValueError(f"{where}: {text} is not a {gen} slice; {gen}-N counts TensorCores "
                         f"(2 per chip), so N is a multiple of 8 (e.g. {gen}-8, {gen}-128)")
    chips = size // 2 if counts_cores else size
    if chips > MAX_CHIPS:
        raise ValueError(f"--topology: {text:.60} has {chips} chips, more than any TPU slice "
                         f"(at most {MAX_CHIPS}); e.g. {gen}-{8 if counts_cores else 4}")
    grid = _grid(chips, rank) if chips > 0 else None
    if grid is None:
        raise ValueError(f"{where}: {text}: {chips} chips is not a standard {gen} slice shape; "
                         f"give the chip grid in JAX's form, e.g. "
                         f"{GENERATIONS[gen][0]}:" + "x".join(["2"] * rank))
    return Topology(text, gen, grid)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 for the duration: libtpu writes its host-detection warnings
    straight to it when it describes a topology on a host with no TPU (nothing to act on)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w", encoding="ascii") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _tpu_attached() -> bool:
    """Whether this host has TPU chips (as JAX's own TPU start-up detects them)."""
    try:
        from jax._src import hardware_utils
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:          # a JAX without the helper: assume chips, keep libtpu's lock
        return True


def topology_devices(topology: Topology | str, num_slices: int = 1) -> list:
    """The compile-only devices of `topology` (`num_slices` copies of it over DCN), one per
    chip. Needs libtpu (`pip install -e ".[tpu]"`); one-line ImportError without it."""
    topo = parse_topology(topology) if isinstance(topology, str) else topology
    if not isinstance(num_slices, int) or isinstance(num_slices, bool) or num_slices < 1:
        raise ValueError(f"--num-slices: must be an integer >= 1, got {num_slices!r}")
    if num_slices > MAX_SLICES:
        raise ValueError(f"--num-slices: {num_slices} is more than {MAX_SLICES} slices; give "
                         "the number of slices of the real deployment")
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        raise ImportError("compiling for a TPU needs libtpu, which is not installed; install "
                           "it with: pip install -e '.[tpu]' (or pip install 'jax[tpu]')")
    from jax.experimental import topologies
    if not _tpu_attached():
        # libtpu takes a host-wide lock file at load, so a second process (a parallel test
        # worker, a second `lwm-jax compile`) fails with "ABORTED ... lockfile". The lock
        # guards the TPU chips; with none attached there is nothing to guard.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs = {"chip_config_name": "megacore"} if GENERATIONS[topo.generation][2] else {}
    kwargs["chips_per_host_bounds"] = topo.host_bounds
    if num_slices > 1:
        kwargs["num_slices"] = num_slices
    try:
        with _quiet_stderr():
            desc = topologies.get_topology_desc(topology_name=topo.jax_name, platform="tpu",
                                                **kwargs)
    except Exception as err:        # e.g. JaxRuntimeError: a grid libtpu does not describe
        detail = " ".join(str(err).split())[:200]
        raise ValueError(f"--topology: libtpu cannot describe {topo.name!r:.60} "
                         f"({type(err).__name__}: {detail}); give a real slice, e.g. v4-32 "
                         "or v5p:4x4x4") from None
    devices = list(desc.devices)
    if len(devices) != topo.chips * num_slices:
        raise RuntimeError(f"--topology {topo.name}: libtpu described {len(devices)} devices, "
                           f"expected {topo.chips * num_slices} (one per chip)")
    return devices
