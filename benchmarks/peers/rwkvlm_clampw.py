"""Peer for `benchmarks/wkv7.py speed` / `accuracy`: RWKV-LM's own WKV7 CUDA kernels (torch).

RWKV-LM `RWKV-v7/train_temp` at its best settings, stated: the kernel its trainer builds
(`src/model.py`, `RWKV7_CLAMPW_CUDA_OP`), compiled with `torch.utils.cpp_extension.load` and
its flags `-res-usage -D_N_=64 -D_CHUNK_LEN_=16 --use_fast_math -O3 -Xptxas -O3
--extra-device-vectorization` (head size 64, a state checkpoint every 16 tokens), bf16
contiguous [B, T, H, 64] inputs, T % 16 == 0. `--variant`: `v3` = rwkv7_clampw_v3_for_h100.cu +
rwkv7_clampw_v3.cpp ("20% faster on H100s", its `@rwkv3` kernel), `v3alt` =
rwkv7_clampw_v3_for_h100_alt.cu ("sometimes faster"), `clampw` = rwkv7_clampw.cu/.cpp (its
default). One variant per process: v3 and v3alt register the same torch.ops namespace. Sources:
`.peer/rwkvlm_cuda/` (or --src), copied there from RWKV-LM's `RWKV-v7/train_temp/cuda/`.

Decay: the kernel takes the decay *logit* u and applies exp(-e^-0.5 sigmoid(u)) itself (the
"clamp"), so it gets u where ours gets w = -e^-0.5 sigmoid(u). Speed inputs are drawn as ours
(`random_wkv7_inputs`' distribution, as `fla_wkv7.py` draws them on the GPU) with u = 2 N(0,1) - 1.
Accuracy uses ours' inputs (`benchmarks/wkv7.py accuracy`: PRNGKey(T), B=1, H=4, D=64,
cotangent PRNGKey(7); the same draws, by JAX on the CPU) with u = logit(w / -e^-0.5) rounded to
bf16, and the float64 reference evaluated at the decay that bf16 u gives; its `dw` is the
gradient w.r.t. u (chain rule applied to the reference's log-decay gradient).
Timer (as `fla_wkv7.py` and ours): one warm-up, one call to size a batch of >= 50 ms, median over
7 batches, one `torch.cuda.synchronize()` per batch; fwd+bwd = forward and the gradients of all
six inputs for a fixed random bf16 cotangent.

    python3 benchmarks/peers/rwkvlm_clampw.py --variant v3 [--src .peer/rwkvlm_cuda] [--build-only]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from torch_timer import time_wkv  # benchmarks/peers/, the script's folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)          # this checkout's lwm_jax: accuracy inputs, float64 reference
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # JAX only draws inputs and runs the reference
SHAPES = [(8, 4096, 12, 64), (4, 4096, 32, 64), (1, 32768, 32, 64), (16, 2048, 32, 64)]
NAMES = ("r", "w", "k", "v", "a", "b")
LB = -math.exp(-0.5)      # the kernel's W_SCALE
DEV = "cuda"              # inputs' device (a CPU stand-in for the kernel tests the script)
HEAD, CHUNK_LEN = 64, 16  # src/model.py: HEAD_SIZE 64, CHUNK_LEN 16 for x070
FLAGS = ["-res-usage", f"-D_N_={HEAD}", f"-D_CHUNK_LEN_={CHUNK_LEN}", "--use_fast_math", "-O3",
         "-Xptxas -O3", "--extra-device-vectorization"]
VARIANTS = {  # name: (extension name, sources, torch.ops namespace)
    "v3": ("rwkv7_clampw_v3", ["rwkv7_clampw_v3_for_h100.cu", "rwkv7_clampw_v3.cpp"],
           "rwkv7_clampw_v3"),
    "v3alt": ("rwkv7_clampw_v3alt", ["rwkv7_clampw_v3_for_h100_alt.cu", "rwkv7_clampw_v3.cpp"],
              "rwkv7_clampw_v3"),
    "clampw": ("rwkv7_clampw", ["rwkv7_clampw.cu", "rwkv7_clampw.cpp"], "rwkv7_clampw"),
}


def emit(**kw):
    print(json.dumps(kw), flush=True)


def build(variant, src):
    import torch
    from torch.utils.cpp_extension import load
    name, files, ns = VARIANTS[variant]
    paths = [os.path.join(src, f) for f in files]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"RWKV-LM sources missing: {missing} (copy RWKV-LM's "
                                "RWKV-v7/train_temp/cuda/rwkv7_clampw* there)")
    load(name=name, sources=paths, is_python_module=False, verbose=False, extra_cuda_cflags=FLAGS)
    return getattr(torch.ops, ns)


def make_fn(ops):
    """(r, w, k, v, a, b) -> y, with w the decay logit; the autograd wrapper of src/model.py."""
    import torch

    class WKV(torch.autograd.Function):
        @staticmethod
        def forward(ctx, r, w, k, v, a, b):
            B, T, H, N = r.shape
            y = torch.empty_like(v)
            s = torch.empty(B, H, T // CHUNK_LEN, N, N, dtype=torch.float32, device=r.device)
            sa = torch.empty(B, T, H, N, dtype=torch.float32, device=r.device)
            ops.forward(r, w, k, v, a, b, y, s, sa)
            ctx.save_for_backward(r, w, k, v, a, b, s, sa)
            return y

        @staticmethod
        def backward(ctx, dy):
            r, w, k, v, a, b, s, sa = ctx.saved_tensors
            grads = [torch.empty_like(x) for x in (r, w, k, v, a, b)]
            ops.backward(r, w, k, v, a, b, dy.contiguous(), s, sa, *grads)
            return tuple(grads)

    def fn(r, w, k, v, a, b):
        xs = (r, w, k, v, a, b)
        assert r.shape[1] % CHUNK_LEN == 0 and r.shape[3] == HEAD
        assert all(x.dtype == torch.bfloat16 and x.is_contiguous() for x in xs)
        return WKV.apply(*xs)
    return fn


def speed_inputs(B, T, H, D, seed=0):
    """Ours' distribution, drawn on the GPU; w as the logit u = 2 N(0,1) - 1."""
    import torch
    g = torch.Generator(device=DEV).manual_seed(seed)
    normal = lambda: torch.randn(B, T, H, D, device=DEV, generator=g)  # noqa: E731
    r, k, v = normal(), 0.5 * normal(), normal()
    u = 2 * normal() - 1
    kk = torch.nn.functional.normalize(normal(), dim=-1)
    icl = torch.sigmoid(normal())
    return [x.to(torch.bfloat16).contiguous() for x in (r, u, k, v, -kk, kk * icl)]


def run_speed(fn, variant, shape_index):
    import torch
    for i, (B, T, H, D) in enumerate(SHAPES):
        if shape_index is not None and i not in shape_index:
            continue
        try:
            xs = speed_inputs(B, T, H, D)
            leaves = [x.detach().requires_grad_(True) for x in xs]
            do = torch.randn(B, T, H, D, device="cuda").to(torch.bfloat16)
            f_ms, fb_ms, peak = time_wkv(fn, xs, leaves, do)
            emit(case="speed", impl=f"rwkvlm-{variant}", B=B, T=T, H=H, D=D, C=CHUNK_LEN,
                 fwd_ms=f_ms, fwdbwd_ms=fb_ms, peak_gib=peak)
        except Exception as e:  # one shape's failure must not hide the others
            emit(case="speed-error", impl=f"rwkvlm-{variant}", B=B, T=T, H=H, D=D,
                 error=f"{type(e).__name__}: {e}"[:400])
        xs = leaves = do = None
        torch.cuda.empty_cache()


def accuracy_inputs(T):
    """Ours' accuracy inputs and cotangent (JAX on the CPU), as float32 NumPy, w as log-decay."""
    import jax
    import jax.numpy as jnp
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs
    with jax.default_device(jax.devices("cpu")[0]):
        xs = random_wkv7_inputs(jax.random.PRNGKey(T), 1, T, 4, 64, 64, jnp.bfloat16)
        do = jax.random.normal(jax.random.PRNGKey(7), (1, T, 4, 64), jnp.float32)
        do = do.astype(jnp.bfloat16)
    return [np.asarray(x.astype(jnp.float32)) for x in xs], np.asarray(do.astype(jnp.float32))


def run_accuracy(fn, variant):
    import torch
    from lwm_jax.ops.wkv7.reference import wkv7_reference_np
    from lwm_jax.ops.wkv7.testing import rel_err, wkv7_reference_vjp_f64
    bf = lambda x: torch.tensor(x, device=DEV).to(torch.bfloat16).contiguous()  # noqa: E731
    for T in (1024, 4096):
        xs, do = accuracy_inputs(T)
        frac = np.clip(xs[1].astype(np.float64) / LB, 1e-30, 1 - 1e-16)
        u = bf(np.log(frac / (1 - frac)))                          # the logit, in bf16
        u64 = u.double().cpu().numpy()
        sig = 1 / (1 + np.exp(-u64))
        ref_xs = [xs[0], LB * sig, *xs[2:]]                        # the decay the kernel sees
        leaves = [bf(x).requires_grad_(True) for x in xs]
        leaves[1] = u.clone().requires_grad_(True)
        if T == 1024:
            o = fn(*leaves)
            got = torch.autograd.grad(o, leaves, bf(do))
            ref_o, _, ref_g = wkv7_reference_vjp_f64(ref_xs, None, None, do.astype(np.float64),
                                                     np.zeros((1, 4, 64, 64)))
            ref_g["w"] = ref_g["w"] * LB * sig * (1 - sig)         # d/du of the log-decay
            errs = {f"d{n}": rel_err(g.float().cpu().numpy(), ref_g[n])
                    for n, g in zip(NAMES, got)}
        else:
            with torch.no_grad():
                o = fn(*leaves)
            ref_o, _ = wkv7_reference_np(*ref_xs)
            errs = {}
        emit(case="accuracy", impl=f"rwkvlm-{variant}", B=1, T=T, H=4, D=64, C=CHUNK_LEN,
             rel_err_fwd=rel_err(o.detach().float().cpu().numpy(), ref_o), w_param="logit",
             **errs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), default="v3")
    p.add_argument("--src", default=os.path.join(ROOT, ".peer", "rwkvlm_cuda"),
                   help="folder holding RWKV-LM's rwkv7_clampw* .cu/.cpp files")
    p.add_argument("--build-only", action="store_true", help="compile the extension and exit")
    p.add_argument("--shape-index", type=int, nargs="*", default=None)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    import torch
    t0 = time.perf_counter()
    try:
        ops = build(args.variant, args.src)
    except Exception as e:  # say why in one row (missing sources, nvcc error) and stop
        emit(case="error", impl=f"rwkvlm-{args.variant}", error=f"{type(e).__name__}: {e}"[-600:])
        return 2
    emit(case="env", impl=f"rwkvlm-{args.variant}", torch=torch.__version__,
         cuda=torch.version.cuda, device=torch.cuda.get_device_name(),
         build_s=round(time.perf_counter() - t0, 1), flags=FLAGS,
         sources=VARIANTS[args.variant][1])
    if args.build_only:
        return 0
    fn = make_fn(ops)
    if not args.skip_speed:
        run_speed(fn, args.variant, args.shape_index)
    if not args.skip_accuracy:
        run_accuracy(fn, args.variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
