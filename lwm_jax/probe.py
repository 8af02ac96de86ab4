"""Probes: named taps on intermediate values of one traced forward pass.

A probe is any callable `probe(name: str, x: jax.Array) -> None`. The model, its blocks and
mixers call it (when one is passed) on every value worth looking at, in execution order, with
names like `"layer3/att/wkv_out"`. Nothing is returned to the forward: a probe only observes, so
the forward computes exactly the same thing with or without one.

`Probe` stores `(name, reduce(name, x))` pairs in call order (a list: a dict would come out of
`jax.jit` with its keys sorted); with the default reduction it keeps the arrays themselves. Probes see tracers when the forward runs under `jax.jit`: return
`probe.records` from the jitted function to get values out. They cannot look inside
`jax.checkpoint` (remat) or `lax.scan` bodies (a tracer would leak); callers build the model
with `remat=False, scan_layers=False` for a probed run (`lwm_jax.diagnostics.nonfinite` does).

A leaf (imports nothing of the package): the models and ops take a probe without
importing `lwm_jax.diagnostics`, which builds its tools on this module.
"""
from __future__ import annotations

from typing import Any, Callable

ProbeFn = Callable[[str, Any], None]


class Probe:
    """Records `(name, reduce(name, x))` for each tap, in call order."""

    def __init__(self, reduce: Callable[[str, Any], Any] | None = None):
        self.reduce = reduce if reduce is not None else (lambda name, x: x)
        self.records: list[tuple[str, Any]] = []
        self._seen: set[str] = set()

    def __call__(self, name: str, x) -> None:
        if name in self._seen:
            raise ValueError(f"probe: tap {name!r} recorded twice in one forward")
        self._seen.add(name)
        self.records.append((name, self.reduce(name, x)))


def scoped(probe: ProbeFn | None, prefix: str) -> ProbeFn | None:
    """A probe that prepends `prefix/` to every name (None stays None)."""
    if probe is None:
        return None
    return lambda name, x: probe(f"{prefix}/{name}", x)
