r"""Peer for `benchmarks/train_step.py`: FLA's `RWKV7ForCausalLM` full training step.

The same shapes as our benchmark (0.1B 8 x 4096, 1.5B 2 x 4096, vocabulary 65536, head size 64,
the low-rank sizes of our configs = the released models'), the same work (forward with the loss,
backward, fused AdamW, `zero_grad`) and the same timer (per-step wall time between
`torch.cuda.synchronize()`s, median over `--steps` (30) after `--warmup`).
Parameter count and MFU as ours: 6 x all parameters x tokens/s over 989 TFLOP/s.

Modes: `amp` = fp32 parameters + bf16 autocast (the like-for-like peer of our `bf16-mixed`),
`fp32` = no autocast, TF32 matmuls allowed (the peer of `fp32-fast`), `bf16-params` = the
whole model in bf16.

Options for FLA at its best, each stated in the row:
  --ce fused    FLA's default: full logits from `lm_head`, then its fused (Triton) cross-entropy
                (config `fuse_cross_entropy=True`, `fuse_linear_cross_entropy=False`)
  --ce linear   its fused *linear* cross-entropy: the head's GEMM and the loss by chunks of
                tokens, no full logits (config `fuse_cross_entropy=False`,
                `fuse_linear_cross_entropy=True`; FLA forbids both at once)
                Both keep FLA's default `use_l2warp=True`.
  --compile     `torch.compile(model)` (default mode; FLA's Triton ops are graph breaks, the
                torch code between them compiles; dynamo's recompile limit raised to 64, since
                the per-layer `layer_idx` specialises each layer). If compiling or a warm-up step
                raises, one row `"case": "compile-failed"` with the error's type and first line is
                printed and the run goes on eagerly; its row then says `"compile": "failed: ..."`.
  --alloc-conf  PYTORCH_CUDA_ALLOC_CONF for this process (e.g. `expandable_segments:True`), set
                before torch is imported; the row states it and the allocator's own
                `expandable_segments` read back after CUDA starts.

Needs torch with CUDA, transformers and the FLA wheels (`fla-core`, `flash-linear-attention`)
and einops; the project itself never imports them (`--help` needs none of them). FLA's Triton
autotuning takes minutes on a fresh machine (inside the warm-up steps; restored from `.peer/` by
`tools/device_throughput.sh`).

    PYTHONPATH=/tmp/site python3 benchmarks/peers/fla_train.py --models 0.1b 1.5b --modes amp
    PYTHONPATH=/tmp/site python3 benchmarks/peers/fla_train.py --models 1.5b --ce linear --compile \
        --alloc-conf expandable_segments:True
"""
from __future__ import annotations

import argparse
import json
import os
import time

MODELS = {   # name: (model kwargs, batch, ctx)
    "0.1b": (dict(hidden_size=768, num_hidden_layers=12, decay_low_rank_dim=64,
                  a_low_rank_dim=64, v_low_rank_dim=32, gate_low_rank_dim=128), 8, 4096),
    "1.5b": (dict(hidden_size=2048, num_hidden_layers=24, decay_low_rank_dim=96,
                  a_low_rank_dim=96, v_low_rank_dim=64, gate_low_rank_dim=256), 2, 4096),
}
PEAK_TFLOPS = 989.0
CE_FIELDS = {   # --ce: FLA 0.6.0 RWKV7Config loss fields
    "fused": dict(fuse_cross_entropy=True, fuse_linear_cross_entropy=False),
    "linear": dict(fuse_cross_entropy=False, fuse_linear_cross_entropy=True),
}
RECOMPILE_LIMIT = 64
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def error_line(e: BaseException) -> str:
    """`Type: first line of the message` (and the next line when the first is only a header
    ending in ':', as dynamo's "backend='inductor' raised:"), at most 300 characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
    return f"{type(e).__name__}: {text}"[:300]


def allocator_settings(torch) -> dict:
    """The allocator configuration as set in the environment and as the allocator reads it."""
    row = {"alloc_conf": os.environ.get(ALLOC_ENV)}
    if os.environ.get("PYTORCH_ALLOC_CONF") is not None:   # torch's newer name, if the image sets it
        row["pytorch_alloc_conf"] = os.environ["PYTORCH_ALLOC_CONF"]
    try:
        settings = torch.cuda.memory._snapshot().get("allocator_settings", {})
        row["expandable_segments"] = settings.get("expandable_segments")
    except Exception:   # a private API: absent or changed in some torch versions
        row["expandable_segments"] = None
    return row


def compile_stats(torch) -> dict:
    """dynamo's counters after the warm-up: graphs compiled and graph breaks."""
    try:
        from torch._dynamo.utils import counters
        return {"compile_graphs": int(counters["stats"]["unique_graphs"]),
                "compile_graph_breaks": int(sum(counters["graph_break"].values()))}
    except Exception:
        return {}


def set_recompile_limit(torch, limit: int) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):   # the newer name, the older one
        if hasattr(cfg, name):
            setattr(cfg, name, limit)


def run(model_name: str, mode: str, steps: int, warmup: int, ce: str, compile_: bool) -> dict:
    import torch
    from fla.models import RWKV7Config, RWKV7ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.zeros(1, device="cuda")   # CUDA up: the allocator has read its configuration
    alloc = allocator_settings(torch)
    kwargs, batch, ctx = MODELS[model_name]
    cfg = RWKV7Config(vocab_size=65536, head_dim=64, **CE_FIELDS[ce], **kwargs)
    with torch.device("cuda"):     # FLA's init runs per-channel loops and QRs: fast on GPU
        model = RWKV7ForCausalLM(cfg)
    if mode == "bf16-params":
        model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randint(0, cfg.vocab_size, (batch, ctx), device="cuda", generator=gen)
              for _ in range(4)]
    base = {"peer": "fla", "model": model_name, "mode": mode, "ce": ce}
    compiled: bool | str = False
    fwd = model
    if compile_:
        torch._dynamo.reset()
        set_recompile_limit(torch, RECOMPILE_LIMIT)
        fwd = torch.compile(model)
        compiled = True

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=(mode == "amp")):
            out = fwd(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    def warm() -> float:
        t0 = time.perf_counter()
        for i in range(warmup):
            step(inputs[i % 4])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    torch.cuda.reset_peak_memory_stats()
    t_start = time.perf_counter()
    try:
        warmup_s = warm()
    except Exception as e:   # only a compiled run falls back; an eager failure is the run's
        if not compile_:
            raise
        err = error_line(e)
        print(json.dumps({**base, "case": "compile-failed", "error": f"compile failed: {err}",
                          "after_s": round(time.perf_counter() - t_start, 1)}), flush=True)
        compiled, fwd = f"failed: {err}", model
        torch._dynamo.reset()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        warmup_s = warm()
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(inputs[i % 4])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tokens = batch * ctx
    row = {**base, "batch": batch, "ctx": ctx,
           "params": n_params, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "step_ms": round(step_s * 1e3, 2),
           "step_ms_min_max": [round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
           "step_ms_all": [round(x * 1e3, 2) for x in times],
           "ktok_s": round(tokens / step_s / 1e3, 2),
           "mfu_pct": round(6 * n_params * tokens / step_s / (PEAK_TFLOPS * 1e12) * 100, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
           "warmup_s": round(warmup_s, 1), "last_loss": float(loss),
           "steps": steps, "warmup": warmup,
           "fla_loss": {k: getattr(cfg, k) for k in
                        ("fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp")},
           "compile": compiled, **alloc}
    if compiled is True:
        row.update(compile_stats(torch), compile_recompile_limit=RECOMPILE_LIMIT)
    return row


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("Options for"):])
    ap.add_argument("--models", nargs="+", default=["0.1b", "1.5b"], choices=sorted(MODELS))
    ap.add_argument("--modes", nargs="+", default=["amp"], choices=["amp", "fp32", "bf16-params"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ce", choices=sorted(CE_FIELDS), default="fused",
                    help="fused: full logits + fused cross-entropy (FLA's default); "
                         "linear: fused linear cross-entropy")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model)")
    ap.add_argument("--alloc-conf", default=None, metavar="STR",
                    help=f"{ALLOC_ENV} for this process, e.g. expandable_segments:True")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    if args.alloc_conf is not None:   # before torch: the allocator reads it when CUDA starts
        os.environ[ALLOC_ENV] = args.alloc_conf
    import torch
    for model_name in args.models:
        for mode in args.modes:
            print(json.dumps(run(model_name, mode, args.steps, args.warmup, args.ce,
                                 args.compile)), flush=True)
            torch.cuda.empty_cache()      # the model and optimizer died with run()'s frame


if __name__ == "__main__":
    main()
