"""Peer for `benchmarks/train_step.py`: jla's own Trainer, a full RWKV-7 training step.

jla = jax-linear-attention 0.1.0 (JAX + equinox + optax; Pallas Mosaic GPU kernels on sm_90), at
its best settings, stated: its `rwkv7-1p3b` preset (RMSNorm pre-norm RWKV-7 blocks, squared-ReLU
channel mix of width 4 d, untied embeddings, WKV on its Mosaic GPU kernel at chunk 32 with
lower_bound -0.61) resized to our shapes: 0.1b = L12 D768 12 x 64 heads, batch 8; 1.5b = L24
D2048 32 x 64 heads, batch 2; vocabulary 65536, ctx 4096; LoRA ranks (decay, a, v, gate) of our
configs, as `fla_train.py` uses ((64, 64, 32, 128) / (96, 96, 64, 256); `--preset-lora` keeps the
preset's (64, 64, 16, 128)). fp32 parameters + bf16 compute (`mode` "amp", like-for-like with our
`bf16-mixed`), its AdamW (lr 6e-4, clip 1.0), its cross-entropy `--ce-impl` (default "auto": its
Mosaic GPU kernel where it applies), synthetic tokens, the step compiled before the loop (its
compile_preflight). `--remat`: its policy (default "none", its fastest where it fits; its
ModelConfig default is "full").

Timer: jla's own per-window step time with `log_every=1` (one metrics read, so one device sync,
per step, as `fla_train.py` syncs per step), median over `--steps` after `--warmup` steps.
Prints one JSON line per model with `fla_train.py`'s fields (`peer`: "jla", `jax` for `torch`);
MFU as ours and FLA's: 6 x all parameters x tokens/s over 989 TFLOP/s (`jla_mfu_pct`: its own
analytic MFU). Several models run one process each (JAX's peak-memory counter cannot be reset).

    python3 -m pip install --no-index --no-deps --target /tmp/site \
        .peer/jax_linear_attention-0.1.0-py3-none-any.whl
    PYTHONPATH=/tmp/site python3 benchmarks/peers/jla_train.py --models 0.1b 1.5b [--remat dots]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time

MODELS = {   # name: (d_model, layers, heads of 64, batch, ctx, our LoRA ranks (decay, a, v, gate))
    "0.1b": (768, 12, 12, 8, 4096, (64, 64, 32, 128)),
    "1.5b": (2048, 24, 32, 2, 4096, (96, 96, 64, 256)),
    "tiny": (128, 2, 2, 1, 128, (16, 16, 8, 16)),      # a CPU smoke test of this script
}
REMAT = ["none", "full", "dots", "dots_with_no_batch_dims", "save_attention", "kernels",
         "dots_kernels", "names", "offload"]     # jla.models.config.RematPolicy
PEAK_TFLOPS = 989.0
VOCAB = 65536


def mapping(args, model_name: str) -> dict:
    """jla's experiment mapping (what its TOML files hold) for one model."""
    d, layers, heads, batch, ctx, lora = MODELS[model_name]
    linear = {"num_k_heads": heads, "num_v_heads": heads, "head_k_dim": 64, "head_v_dim": 64,
              "chunk_size": 32}
    if not args.preset_lora:
        linear["rwkv7_lora_dims"] = list(lora)
    return {
        "name": f"jla-rwkv7-{model_name}",
        "model": {"preset": "rwkv7-1p3b", "vocab_size": VOCAB, "d_model": d, "n_layers": layers,
                  "d_ff": 4 * d, "layer_types": ["rwkv7"] * layers,
                  "mlp_types": ["rwkv7_cmix"] * layers, "param_dtype": "float32",
                  "compute_dtype": "bfloat16", "remat": args.remat, "linear_attention": linear},
        "train": {"max_steps": args.warmup + args.steps, "seq_len": ctx,
                  "micro_batch_per_replica": batch, "log_every": 1, "eval_every": 0,
                  "final_eval": False, "save_every": 0, "save_final": False, "resume": "never",
                  "ce_impl": args.ce_impl, "dispatch_ahead": args.dispatch_ahead,
                  "output_dir": os.path.join(args.workdir, f"jla_train_{model_name}")},
        "data": {"source": "synthetic"},
        "optim": {"name": "adamw", "lr": 6e-4, "warmup_steps": 0},
    }


def run(args, model_name: str) -> dict:
    import equinox as eqx
    import jax
    import numpy as np
    from importlib.metadata import version
    from jla.config import config_from_mapping
    from jla.launch_env import launch
    from jla.training.trainer import Trainer

    raw = mapping(args, model_name)
    cfg = config_from_mapping(raw)
    launch(cfg.runtime)        # as `jla train` does before any device is touched (its defaults)
    d, layers, heads, batch, ctx, _ = MODELS[model_name]
    t0 = time.perf_counter()
    res = Trainer(cfg).run()
    wall_s = time.perf_counter() - t0
    records = res.history[args.warmup:]
    if args.dispatch_ahead and len(records) > 1:
        records = records[:-1]   # its docs: the last window comes out short with dispatch_ahead
    if not records:
        raise RuntimeError(f"no timed steps: {len(res.history)} records, warmup {args.warmup}")
    times = [float(r["step_time"]) for r in records]
    step_s = statistics.median(times)
    params = eqx.filter(res.model, eqx.is_inexact_array)
    n_params = int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))
    tokens = batch * ctx
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"peer": "jla", "model": model_name, "mode": "amp", "batch": batch, "ctx": ctx,
            "params": n_params, "device": str(dev.device_kind), "jax": jax.__version__,
            "jla": version("jax-linear-attention"), "remat": args.remat,
            "ce_impl": args.ce_impl, "dispatch_ahead": args.dispatch_ahead,
            "lora": raw["model"]["linear_attention"].get("rwkv7_lora_dims", "preset"),
            "step_ms": round(step_s * 1e3, 2),
            "step_ms_min_max": [round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
            "step_ms_all": [round(x * 1e3, 2) for x in times],
            "ktok_s": round(tokens / step_s / 1e3, 2),
            "mfu_pct": round(6 * n_params * tokens / step_s / (PEAK_TFLOPS * 1e12) * 100, 2),
            "jla_mfu_pct": round(statistics.median(float(r.get("mfu_percent", 0.0))
                                                   for r in records), 2),
            "peak_gib": None if peak is None else round(peak / 2**30, 2),
            "warmup_s": round(wall_s - sum(times), 1),
            "last_loss": float(res.history[-1]["loss"])}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["0.1b", "1.5b"], choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--remat", default="none", choices=REMAT)
    ap.add_argument("--ce-impl", default="auto", choices=["auto", "mosaic_gpu", "xla"])
    ap.add_argument("--dispatch-ahead", action="store_true",
                    help="its train.dispatch_ahead (off by default in jla)")
    ap.add_argument("--preset-lora", action="store_true",
                    help="keep the rwkv7-1p3b preset's LoRA ranks (64, 64, 16, 128)")
    ap.add_argument("--workdir", default="/tmp", help="where jla writes its run folders")
    ap.add_argument("--print-mapping", action="store_true",
                    help="print the jla config mapping of each model and exit (no jla needed)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.print_mapping:
        for m in args.models:
            print(json.dumps(mapping(args, m)), flush=True)
        return 0
    if len(args.models) > 1:     # one process per model: a fresh peak-memory counter each
        rest = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--remat", args.remat,
                "--ce-impl", args.ce_impl, "--workdir", args.workdir]
        rest += ["--dispatch-ahead"] * args.dispatch_ahead + ["--preset-lora"] * args.preset_lora
        rc = 0
        for m in args.models:
            rc |= subprocess.run([sys.executable, os.path.abspath(__file__), "--models", m,
                                  *rest]).returncode
        return rc
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    name = args.models[0]
    try:
        row = run(args, name)
    except Exception as e:  # one line that says why (memory, say: try --remat dots)
        print(json.dumps({"peer": "jla", "model": name, "mode": "amp", "remat": args.remat,
                          "error": f"{type(e).__name__}: {e}"[:600]}), flush=True)
        return 1
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
