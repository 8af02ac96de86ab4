"""Numerical diagnostics: probes into the forward pass and the non-finite localiser."""
from lwm_jax.diagnostics.probe import Probe, scoped

__all__ = ["Probe", "scoped"]
