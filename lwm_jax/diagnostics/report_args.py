"""Arguments of `lwm-jax precision-report` (light: imports no JAX, so `lwm-jax --help` stays
fast; the implementation is `lwm_jax.diagnostics.report_cli`)."""
from __future__ import annotations

import argparse

from lwm_jax.cli_args import FORMATS

HELP = "where a precision policy loses accuracy: per-layer, per-op errors and a heat map"
DESCRIPTION = (
    "Run one batch through a model under a precision policy and under a shadow policy (default "
    "fp32) in this process; measure every layer's sub-ops (RWKV-7: decay, WKV, ln_x, FFN; "
    "LLaMA: attention, RMSNorm, MLP, RoPE; both: logits, loss) against float64 formulas on "
    "the run's own inputs and against the shadow, and each parameter group's gradient. Prints "
    "a table, writes report.json and heatmap.png, and names the worst offender with the "
    "policy change that would fix it. The model: --checkpoint's as trained; otherwise the "
    "config's initialisation, warmed (its zero-initialised projections and constant norms "
    "drawn at a trained-like scale from --seed, since a zero projection measures as exact in "
    "every precision); every output names the model studied.")


def add_precision_report_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", "-c", default=None, metavar="YAML",
                     help="run config whose model is built at its initialisation and warmed "
                          "(default: the built-in tiny config); KEY=VALUE overrides apply to it")
    src.add_argument("--checkpoint", default=None,
                     help="study a trained model instead: our converted directory, a training "
                          "run directory (its newest step, e.g. runs/tiny after lwm-jax train), "
                          "an official .pth file or an HF directory")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. model.n_layer=2 runtime.chunk_size=16")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="checkpoint format (default: detected from the path)")
    p.add_argument("--policy", default=None,
                   help="precision policy to examine (default: the config's precision; "
                        "bf16-mixed for a checkpoint)")
    p.add_argument("--shadow", default="fp32",
                   help="reference policy for end-to-end and gradient errors; none = local "
                        "errors only (one run)")
    p.add_argument("--data", default="auto", choices=("auto", "corpus", "random"),
                   help="batch: the embedded byte-level corpus or uniform random tokens; auto = "
                        "corpus for a byte-level model (vocab 256), random otherwise")
    p.add_argument("--batch-size", type=int, default=2, help="sequences in the batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the batch (window or tokens) and of the warming noise; an "
                        "integer in [0, 2**63)")
    p.add_argument("--no-warm", action="store_true",
                   help="study the initialisation as built (zero-initialised projections then "
                        "measure as exact); not with --checkpoint")
    p.add_argument("--no-gradients", action="store_true",
                   help="skip the gradient comparison (saves one compilation per policy)")
    p.add_argument("--output", "-o", default="precision_report",
                   help="directory for report.json and heatmap.png")
    return p
