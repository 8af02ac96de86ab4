"""Numerical diagnostics: probes into the forward pass (`Probe`, `scoped`, from the hook the
models call, `lwm_jax.probe`), the non-finite localiser (`nonfinite`) and the precision
report (`precision_report`: per-layer, per-op errors of a policy against float64 and a shadow
policy; `lwm-jax precision-report`)."""
from lwm_jax.probe import Probe, scoped

__all__ = ["Probe", "scoped"]
