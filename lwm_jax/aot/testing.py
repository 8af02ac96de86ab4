"""Helpers for tests that compile for real TPU topologies on a CPU host (libtpu, no TPU).

`devices(generation, chips)`: compile-only devices of one of `GENERATIONS` (cached per
process); `compile_for(fn, *args)`: jit, lower and compile with `ShapeDtypeStruct` arguments and
return `(compiled, seconds)`; `mosaic_calls(compiled)`: the Mosaic kernels (`tpu_custom_call`)
in the compiled program; `report(...)`: one line for the suite's "TPU compile" summary.
"""
from __future__ import annotations

import functools
import re
import time

import jax

from lwm_jax.aot.topology import topology_devices

# generation -> JAX topology names by chip count (1 chip, 4 chips)
GENERATIONS = {
    "v4": {1: "v4:1x1x1", 4: "v4:2x2x1"},
    "v5e": {1: "v5e:1x1", 4: "v5e:2x2"},
    "v5p": {1: "v5p:1x1x1", 4: "v5p:2x2x1"},
    "v6e": {1: "v6e:1x1", 4: "v6e:2x2"},
}


@functools.cache
def devices(generation: str, chips: int = 1) -> tuple:
    """The compile-only devices of `chips` chips of `generation` ("v4", "v5e", "v5p", "v6e")."""
    return tuple(topology_devices(GENERATIONS[generation][chips]))


def compile_for(fn, *args, **jit_kwargs):
    """`(compiled, seconds)`: `jax.jit(fn, **jit_kwargs)` compiled for the shardings' devices."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def mosaic_calls(compiled) -> list[str]:
    """The HLO lines of the Mosaic kernel calls in a compiled TPU program."""
    return [line for line in compiled.as_text().splitlines()
            if 'custom_call_target="tpu_custom_call"' in line]


def scoped_vmem(compiled) -> str:
    """What XLA:TPU recorded about the kernels' scoped VMEM: the `scoped_memory_configs` of each
    Mosaic call ("default limit" when empty, as it is for kernels that set no limit)."""
    found = set()
    for line in mosaic_calls(compiled):
        m = re.search(r'"scoped_memory_configs":(\[[^\]]*\])', line)
        found.add(m.group(1) if m else "not in the HLO text")
    if found == {"[]"}:
        return "default limit (no kernel sets one)"
    return ", ".join(sorted("default limit" if f == "[]" else f for f in found))


def report(record_property, generation: str, what: str, compiled, seconds: float) -> None:
    """Record one compile for the summary `tests/conftest.py` prints at the end of the run."""
    mem = compiled.memory_analysis()
    temp = f"{mem.temp_size_in_bytes / 2**20:.1f} MiB temp" if mem is not None else "no analysis"
    record_property("tpu_compile", f"{generation:<4} {what}: {len(mosaic_calls(compiled))} "
                    f"Mosaic call(s), {temp}, scoped VMEM {scoped_vmem(compiled)}, "
                    f"{seconds:.1f} s")
