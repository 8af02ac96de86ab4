"""Numerical diagnostics: probes into the forward pass (`Probe`, `scoped`, from the hook the
models call, `lwm_jax.probe`) and the tools built on them.

Modules:
  * `nonfinite`: where the first NaN/inf came from (a probed forward with per-tap statistics);
  * `precision_report`: per-layer, per-op errors of a precision policy against float64 and a
    shadow policy (`lwm-jax precision-report`);
  * `precision_fp8`: the report under an FP8 policy (calibrated scales, their trajectories,
    the check that every GEMM meant to be FP8 ran as one);
  * `subops`: what a sub-op is for the report (its tap, its float64 reference, its floor);
  * `subops_rwkv7`, `subops_llama`: each family's table of sub-ops;
  * `warm`: random trained-like values for an initialisation's zero and constant parameters;
  * `precision_plot`: heat maps of a report (matplotlib, Agg);
  * `report_cli`: the report's command once the model exists (batch, warm, run, write files).
"""
from lwm_jax.probe import Probe, scoped

__all__ = ["Probe", "scoped"]
