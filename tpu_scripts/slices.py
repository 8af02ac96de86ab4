"""Cloud TPU slice shapes and the names gcloud accepts, checked before anything is run.

Accelerator types (`gcloud compute tpus tpu-vm create --accelerator-type`), per generation:

| type          | generation | N counts             | chips per host (VM)      | runtime version     |
|---------------|------------|----------------------|--------------------------|---------------------|
| `v4-N`        | v4         | TensorCores (2/chip) | 4                        | tpu-ubuntu2204-base |
| `v5p-N`       | v5p        | TensorCores (2/chip) | 4                        | v2-alpha-tpuv5      |
| `v5litepod-N` | v5e        | chips                | N for N <= 8 (one host), else 4 | v2-alpha-tpuv5-lite |
| `v6e-N`       | v6e        | chips                | N for N <= 8 (one host), else 4 | v2-alpha-tpuv6e     |

v4 and v5p chips run both TensorCores as one JAX device (megacore), so for every generation JAX
sees one device per chip: `v4-32` is 16 devices on 4 hosts, `v5p-128` 64 devices on 16 hosts,
`v5litepod-16` 16 devices on 4 hosts, `v6e-8` 8 devices on one host. The runtime versions are
the ones Google's "TPU software versions" page names for JAX on each generation.
"""
from __future__ import annotations

import dataclasses
import re

from tpu_scripts.quoting import clip

# generation prefix -> (the size counts TensorCores, default runtime version)
_GENERATIONS = {
    "v4": (True, "tpu-ubuntu2204-base"),
    "v5p": (True, "v2-alpha-tpuv5"),
    "v5litepod": (False, "v2-alpha-tpuv5-lite"),
    "v6e": (False, "v2-alpha-tpuv6e"),
}
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "v6": "v6e", "v5": "v5p"}
_SINGLE_HOST_CHIP_COUNTS = (1, 4, 8)       # v5e / v6e slices that are one VM
CHIPS_PER_HOST = 4                          # every multi-host slice of these generations

_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
_PROJECT = re.compile(r"^([a-z0-9.-]+:)?[a-z][-a-z0-9]{4,28}[a-z0-9]$")


@dataclasses.dataclass(frozen=True)
class Slice:
    """One accelerator type. `chips`: JAX devices in the slice; `hosts`: TPU VMs (workers)."""

    accelerator_type: str
    generation: str
    chips: int
    hosts: int
    runtime_version: str

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1


def parse_accelerator_type(text: str) -> Slice:
    """`"v4-32"` -> `Slice(chips=16, hosts=4, ...)`. ValueError (one line) for anything else."""
    where = "--accelerator-type"
    m = re.fullmatch(r"([a-z0-9]+)-([0-9]+)", text or "")
    if not m:
        raise ValueError(f"{where}: {clip(text, 60)} is not an accelerator type; expected "
                         "GENERATION-SIZE such as v4-32, v5p-128, v5litepod-16 or v6e-8")
    gen, size = m.group(1), int(m.group(2))
    if gen not in _GENERATIONS:
        hint = (f"; for {gen} write {_ALIASES[gen]}-{size}" if gen in _ALIASES
                else "")
        raise ValueError(f"{where}: unknown TPU generation {gen!r} in {text!r}; known: "
                         f"{', '.join(_GENERATIONS)}{hint}")
    counts_cores, runtime = _GENERATIONS[gen]
    if counts_cores:
        if size < 8 or size % 8:
            raise ValueError(f"{where}: {text} is not a {gen} slice; {gen}-N counts "
                             "TensorCores (2 per chip, 4 chips per host), so N is a multiple "
                             f"of 8 (e.g. {gen}-8, {gen}-32)")
        chips = size // 2
        hosts = chips // CHIPS_PER_HOST
    else:
        if size not in _SINGLE_HOST_CHIP_COUNTS and (size % 16 or size > 256):
            raise ValueError(f"{where}: {text} is not a {gen} slice; {gen}-N counts chips: "
                             "1, 4 or 8 on one host, or 16, 32, ... 256 on 4 chips per host")
        chips = size
        hosts = 1 if size in _SINGLE_HOST_CHIP_COUNTS else size // CHIPS_PER_HOST
    return Slice(text, gen, chips, hosts, runtime)


def check_tpu_name(name: str) -> str:
    """A TPU / queued-resource name gcloud accepts (lower case, digits, '-', <= 63)."""
    if not _NAME.match(name or ""):
        raise ValueError(f"TPU name {clip(name, 70)}: use 1-63 lower-case letters, digits and '-', "
                         "starting with a letter and not ending with '-' (e.g. lwm-v4-32)")
    return name


def check_zone(zone: str | None) -> str:
    if not zone:
        raise ValueError("--zone: not given and CLOUDSDK_COMPUTE_ZONE is not set; pass the "
                         "TPU's zone, e.g. --zone us-central2-b")
    if not _ZONE.match(zone):
        raise ValueError(f"--zone: {clip(zone, 60)} is not a zone name; expected REGION-ZONE such "
                         "as us-central2-b or europe-west4-a")
    return zone


def check_project(project: str | None) -> str:
    if not project:
        raise ValueError("--project: not given and CLOUDSDK_CORE_PROJECT is not set; pass "
                         "your Google Cloud project id, e.g. --project my-project")
    if not _PROJECT.match(project):
        raise ValueError(f"--project: {clip(project, 60)} is not a project id (6-30 lower-case "
                         "letters, digits and '-', starting with a letter)")
    return project
