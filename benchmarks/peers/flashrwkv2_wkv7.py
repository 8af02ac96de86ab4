"""Peer: flashrwkv2 0.1.0a17's WKV7 training op (torch, TileLang), checked and timed.

The call: `flashrwkv2.pretrain_tmix_wkv7_recurrent_bf16(r, w, k, v, a, b, head_size=64)`, the
package's dense training entry (module `flashrwkv2/tmix/wkv7/pretrain.py`; its only other
differentiable WKV entry, `rl_infctx_tmix_wkv7_recurrent_bf16`, is the same kernel on packed
[N, H, D] tokens with a state pool). There is no chunked or fp32-input variant: one
token-recurrent TileLang kernel, bf16 token IO, fp32 state and arithmetic (explicit FMAs, no
fast math, nvcc --fmad=false), an fp32 state checkpoint every 16 tokens for the backward, fp32
gradient accumulation rounded to bf16.

What it expects, and how ours' inputs map onto it (read from the wheel, `tmix/wkv7/tilelang.py`):
- every tensor bf16, CUDA, contiguous, shape [B, T, C] with C = H * head_size, head_size in
  {64, 128, 256}; any T >= 1 (no multiple-of constraint). Ours are [B, T, H, D]: passed as the
  free view `x.reshape(B, T, H * D)`; the output comes back [B, T, C] and is viewed [B, T, H, D].
- w is the decay *logit* u: the kernel forms exp(-e^-0.5 sigmoid(u)) itself (as RWKV-LM's
  clampw kernels do), where ours takes the log decay w = -e^-0.5 sigmoid(u). Speed inputs draw
  u = 2 N(0,1) - 1 directly (`rwkvlm_clampw.speed_inputs`, ours' distribution); accuracy uses
  ours' inputs with u = logit(w / -e^-0.5) rounded to bf16 and checks against the float64
  reference evaluated at the decay that bf16 u gives; `dw` is d/du (chain rule on the log-decay
  gradient).
- a, b, r, k, v in ours' convention unchanged: state S[key, value],
  S_t = diag(decay_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T, o_t = S_t^T r_t, scale 1, zero
  initial state (the wrapper allocates it and cu_seqlens on every call: counted, as its API does).
So `.peer/wkv7_peers.py`'s call (same view, u as w, a = -kk, b = kk * a, bf16, contiguous, no
missing argument) is the API's contract as read: its NaN is not explained by parameterisation,
layout, dtype or T. The check below says where non-finite values start (token 0: a kernel that
does not write; later: a blow-up) and the probes which term is involved.

First use: TileLang JIT-compiles each kernel variant (forward with / without checkpoints, backward)
once per head count (heads is a compile-time argument: 4 for the check, 12 and 32 for the anchor
shapes) and caches it on disk (TILELANG_CACHE_DIR). The package never tunes on an ordinary call:
without a verified profile in FLASHRWKV2_CACHE_DIR it runs its default (64 value columns per CTA,
one token per shared-memory load) and warns. `--tune` runs its explicit
`prepare_tuning(..., mode="tune")` per shape (4 forward configurations, each compiled, checked
bitwise and timed by CUDA-graph replay); results are small JSON files there. To keep compiles out of
the guarded phases, a first phase compiles every variant the run needs in parallel (`par_compile`
of the package's own kernel builders, same arguments as its launcher, so its calls then load them
from the disk cache). `--save-cache F` tars both caches (TileLang kernels, flashrwkv2 tuning
profiles) into F; `--restore-cache F` unpacks F first if it exists (copy it into .peer/ and carry
it, like FLA's autotune results: later calls skip the compiles and, with --tune, the tuning).

Phases, each its own process under its own timeout (a compile or tuning cannot eat the call), all
under --budget: precompile, check (B=1, H=4, D=64, T=1024: one JSON row per quantity o_nograd, o,
dr, dw, dk, dv, da, db vs the float64 recurrence of `lwm_jax.ops.wkv7.testing`; when anything is
non-finite, three small probes vs a fp32 torch recurrence and one `ERROR ...` line), then one per
speed shape (torch_timer's timer, as `fla_wkv7.py` and `rwkvlm_clampw.py`: fwd on inputs without
grad; fwd+bwd = forward and the gradients of all six inputs for a fixed random bf16 cotangent).

Device (repo root, .peer/ carried; no network there: the two wheels, the tilelang tree and libz3
from .peer/ as `.peer/peers_run.sh` installs them; torch and tilelang's small deps are in the image):
  export PYTHONPATH=$PWD OUT; S=/tmp/site; mkdir -p $S/z3/lib && python3 -m pip install -q \
    --no-index --no-deps --no-compile --target $S .peer/flashrwkv2-0.1.0a17-py3-none-any.whl \
    .peer/apache_tvm_ffi-0.1.12-*.whl && python3 -c "import lzma,tarfile,sys; s=sys.argv[1]; \
    tarfile.open('.peer/tilelang-0.1.15-site.tar.xz').extractall(s); open(s+'/z3/lib/libz3.so.4.15',\
    'wb').write(lzma.open('.peer/libz3.so.4.15.xz').read())" $S && ln -sf libz3.so.4.15 \
    $S/z3/lib/libz3.so && touch $S/z3/__init__.py && PYTHONPATH=$S:$PWD \
    FLASHRWKV2_PEER_LOG=$OUT/flashrwkv2_full.log timeout 530 python3 \
    benchmarks/peers/flashrwkv2_wkv7.py --budget 480 --restore-cache .peer/flashrwkv2_cache_H200.tgz \
    --save-cache $OUT/flashrwkv2_cache_H200.tgz 2>&1 | tee $OUT/flashrwkv2.jsonl
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
SHAPES = [(8, 4096, 12, 64), (4, 4096, 32, 64), (1, 32768, 32, 64), (16, 2048, 32, 64)]
CHECK = (1, 1024, 4, 64)     # B, T, H, D of the accuracy check
NAMES = ("r", "w", "k", "v", "a", "b")
LB = -math.exp(-0.5)
IMPL = "flashrwkv2-0.1.0a17"
NEEDED = ("torch", "tilelang", "tvm_ffi", "flashrwkv2")
DEV = "cuda"              # the inputs' device (a CPU stand-in for flashrwkv2 tests the script)


def emit(**kw):
    print(json.dumps(kw), flush=True)


def shape_arg(text):
    parts = [int(x) for x in text.split(",")]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not B,T,H,D")
    return tuple(parts)


# ---------------------------------------------------------------- in the worker processes

def op():
    """(r, w, k, v, a, b) [B, T, H, D] bf16, w the decay logit -> o [B, T, H, D]."""
    import flashrwkv2

    def fn(r, w, k, v, a, b):
        B, T, H, D = r.shape
        flat = [x.reshape(B, T, H * D) for x in (r, w, k, v, a, b)]
        return flashrwkv2.pretrain_tmix_wkv7_recurrent_bf16(*flat, head_size=D).view(B, T, H, D)
    return fn


def kernel_variants(heads_list, D, tune):
    """The package's (forward, backward) kernel builder arguments this run launches.

    Positional, as `flashrwkv2/tmix/wkv7/tilelang.py`'s `_forward` / `_infer_recurrent` /
    `_recurrent_vjp` pass them: forward (heads, dim, scale, has_bias, save, block_values,
    has_status, indexed, bias_dtype, prefetch_tokens, state_dtype); backward (heads, dim, scale,
    has_bias, has_status, bias_dtype)."""
    fwd, bwd = [], []
    for h in sorted(set(heads_list)):
        configs = [(64, 1)] + ([(64, 4), (32, 1), (32, 4)] if tune else [])
        for bv, pf in configs:
            for save in ((True, False) if (bv, pf) == (64, 1) else (False,)):
                fwd.append((h, D, 1.0, False, save, bv, False, False, "float32", pf, "float32"))
            if tune:   # the tuner also checks the indexed inference launch of each candidate
                fwd.append((h, D, 1.0, False, False, bv, True, True, "float32", pf, "float32"))
        bwd.append((h, D, 1.0, False, False, "float32"))
    return fwd, bwd


def worker_precompile(args):
    from flashrwkv2.tmix.wkv7 import tilelang as impl
    fwd, bwd = [], []
    groups = [([CHECK[2]], CHECK[3], False)]                # the check is never tuned
    groups += [([s[2] for s in args.shapes if s[3] == D], D, args.tune)
               for D in sorted({s[3] for s in args.shapes})]
    for heads, D, tune in groups:
        f, b = kernel_variants(heads, D, tune)
        fwd += [c for c in f if c not in fwd]
        bwd += [c for c in b if c not in bwd]
    heads = [CHECK[2]] + [s[2] for s in args.shapes]
    t0 = time.perf_counter()
    n_ok = 0
    for builder, cfgs in ((impl._forward_kernel, fwd), (impl._backward_kernel, bwd)):
        kernels = builder.par_compile(cfgs, num_workers=args.workers, ignore_error=True)
        n_ok += sum(k is not None for k in kernels)
    emit(case="precompile", impl=IMPL, kernels=len(fwd) + len(bwd), compiled=n_ok,
         heads=sorted(set(heads)), tune_candidates=args.tune,
         seconds=round(time.perf_counter() - t0, 1),
         tilelang_cache=os.environ.get("TILELANG_CACHE_DIR"))


def env_row():
    import importlib.metadata as md
    import torch
    vers = {}
    for p in ("torch", "tilelang", "apache-tvm-ffi", "flashrwkv2", "torch-c-dlpack-ext", "jax"):
        try:
            vers[p] = md.version(p)
        except Exception:
            vers[p] = None
    cap = torch.cuda.get_device_capability()
    emit(case="env", impl=IMPL, device=torch.cuda.get_device_name(), cc=f"{cap[0]}.{cap[1]}",
         cuda=torch.version.cuda, versions=vers,
         tilelang_backend=os.environ.get("TILELANG_EXECUTION_BACKEND", "auto"),
         tilelang_cache=os.environ.get("TILELANG_CACHE_DIR"),
         flashrwkv2_cache=os.environ.get("FLASHRWKV2_CACHE_DIR"))


def finite_stats(t):
    """(fraction non-finite, first token index with a non-finite value or None) of [B, T, ...]."""
    import torch
    bad = ~torch.isfinite(t.float())
    frac = float(bad.float().mean())
    if frac == 0:
        return 0.0, None
    per_token = bad.reshape(t.shape[0], t.shape[1], -1).any(-1).any(0)
    return frac, int(per_token.nonzero()[0, 0])


def worker_check(args):
    import numpy as np
    import torch
    from rwkvlm_clampw import accuracy_inputs           # ours' inputs (JAX, CPU), w as log decay
    from lwm_jax.ops.wkv7.testing import rel_err, wkv7_reference_vjp_f64
    env_row()
    fn = op()
    B, T, H, D = CHECK
    xs, do = accuracy_inputs(T)                          # float32 NumPy, bf16-valued
    bf = lambda x: torch.tensor(x, device=DEV).to(torch.bfloat16).contiguous()  # noqa: E731
    frac = np.clip(xs[1].astype(np.float64) / LB, 1e-30, 1 - 1e-16)
    u = bf(np.log(frac / (1 - frac)))                    # the logit the kernel takes, bf16
    sig = 1 / (1 + np.exp(-u.double().cpu().numpy()))
    ref_xs = [xs[0], LB * sig, *xs[2:]]                  # the decay that bf16 u gives
    leaves = [bf(x) for x in xs]
    leaves[1] = u
    t0 = time.perf_counter()
    with torch.no_grad():
        o_nograd = fn(*leaves)                           # forward without checkpoints
    torch.cuda.synchronize()
    first_fwd_s = time.perf_counter() - t0
    leaves = [x.clone().requires_grad_(True) for x in leaves]
    t0 = time.perf_counter()
    o = fn(*leaves)
    got = torch.autograd.grad(o, leaves, bf(do))
    torch.cuda.synchronize()
    first_fwdbwd_s = time.perf_counter() - t0
    ref_o, _, ref_g = wkv7_reference_vjp_f64(ref_xs, None, None, do.astype(np.float64),
                                             np.zeros((B, H, D, D)))
    ref_g["w"] = ref_g["w"] * LB * sig * (1 - sig)       # d/du of the log decay
    rows = [("o_nograd", o_nograd, ref_o), ("o", o, ref_o)]
    rows += [(f"d{n}", g, ref_g[n]) for n, g in zip(NAMES, got)]
    bad = []
    for name, x, ref in rows:
        fr, first = finite_stats(x.detach())
        xn = x.detach().float().cpu().numpy()
        err = rel_err(np.nan_to_num(xn, nan=0.0, posinf=0.0, neginf=0.0), ref) if fr else \
            rel_err(xn, ref)
        emit(case="accuracy", impl=IMPL, quantity=name, B=B, T=T, H=H, D=D, w_param="logit",
             rel_err=None if fr else err, rel_err_finite_part=err if fr else None,
             nonfinite_frac=fr, first_nonfinite_token=first,
             max_abs=float(np.nanmax(np.abs(np.where(np.isfinite(xn), xn, np.nan))))
             if np.isfinite(xn).any() else None)
        if fr:
            bad.append(f"{name} ({fr:.1%} from token {first})")
    emit(case="first-call", impl=IMPL, fwd_nograd_s=round(first_fwd_s, 1),
         fwdbwd_s=round(first_fwdbwd_s, 1))
    if bad:
        # Tell a kernel that never writes (NaN from token 0, uninitialised output) from one that
        # blows up later; and whether the decay transform or the a/b term is involved.
        probe(fn)
        print(f"ERROR {IMPL}: non-finite values in " + ", ".join(bad), flush=True)
        return 3
    return 0


def probe(fn):
    """Small diagnostic cases on a fp32 torch recurrence (GPU): T=16/17, with a = b = 0 and not."""
    import torch
    g = torch.Generator(device=DEV).manual_seed(1)
    for T, ab in ((16, False), (17, True), (64, True)):
        n = lambda: torch.randn(1, T, 4, 64, device=DEV, generator=g)  # noqa: E731
        r, k, v, u = n(), 0.5 * n(), n(), 2 * n() - 1
        kk = torch.nn.functional.normalize(n(), dim=-1)
        a, b = (-kk, kk * torch.sigmoid(n())) if ab else (0 * kk, 0 * kk)
        xs = [x.to(torch.bfloat16).contiguous() for x in (r, u, k, v, a, b)]
        with torch.no_grad():
            o = fn(*xs).float()
        f = [x.float() for x in xs]
        decay = torch.exp(LB * torch.sigmoid(f[1]))
        S = torch.zeros(1, 4, 64, 64, device=DEV)
        ref = []
        for t in range(T):
            sa = torch.einsum("bhk,bhkv->bhv", f[4][:, t], S)
            S = decay[:, t, ..., None] * S + f[5][:, t, ..., None] * sa[:, :, None] \
                + f[2][:, t, ..., None] * f[3][:, t, :, None, :]
            ref.append(torch.einsum("bhk,bhkv->bhv", f[0][:, t], S))
        ref = torch.stack(ref, 1)
        fr, first = finite_stats(o)
        err = float((torch.nan_to_num(o) - ref).norm() / ref.norm())
        emit(case="probe", impl=IMPL, T=T, ab_term=ab, nonfinite_frac=fr,
             first_nonfinite_token=first, rel_err_vs_fp32=err)


def worker_speed(args):
    import torch
    import flashrwkv2
    from rwkvlm_clampw import speed_inputs               # ours' distribution, w as the logit
    from torch_timer import time_wkv
    B, T, H, D = args.shapes[0]
    fn = op()
    xs = speed_inputs(B, T, H, D)
    leaves = [x.detach().requires_grad_(True) for x in xs]
    do = torch.randn(B, T, H, D, device=DEV).to(torch.bfloat16)
    tune_report = None
    if args.tune:
        t0 = time.perf_counter()
        rep = flashrwkv2.prepare_tuning([lambda: torch.autograd.grad(fn(*leaves), leaves, do)],
                                        mode="tune")
        tune_report = {"seconds": round(time.perf_counter() - t0, 1), "counts": rep["counts"],
                       "configs": [r["config"] for r in rep["records"]]}
    t0 = time.perf_counter()
    torch.autograd.grad(fn(*leaves), leaves, do)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    f_ms, fb_ms, peak = time_wkv(fn, xs, leaves, do)
    emit(case="speed", impl=IMPL, B=B, T=T, H=H, D=D, fwd_ms=f_ms, fwdbwd_ms=fb_ms,
         peak_gib=peak, first_fwdbwd_s=round(first, 1),
         tuned=tune_report is not None, tuning=tune_report)
    return 0


# ---------------------------------------------------------------- the driving process

def run_phase(name, argv, timeout, env):
    """Run this file as a worker under `timeout` s, streaming its JSON/ERROR lines; a row if it
    fails. The worker gets its own process group, killed whole on timeout (its nvcc children too)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    fired = []

    def kill():
        fired.append(True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    timer = threading.Timer(timeout, kill)
    timer.start()
    lines = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if line.startswith("{") or line.startswith("ERROR"):
            print(line, flush=True)
    rc = proc.wait()
    timer.cancel()
    rc = "timeout" if fired else rc
    if rc != 0:
        tail = [x for x in lines if x.strip() and not x.startswith("{")][-3:]
        emit(case="phase-failed", impl=IMPL, phase=name, rc=rc, limit_s=round(timeout),
             seconds=round(time.perf_counter() - t0, 1), tail=" | ".join(tail)[-600:])
    if os.environ.get("FLASHRWKV2_PEER_LOG"):      # every line of every phase, for the record
        with open(os.environ["FLASHRWKV2_PEER_LOG"], "a") as f:
            f.write(f"===== {name} rc={rc}\n" + "\n".join(lines) + "\n")
    return rc


def cache_dirs():
    return [os.environ["TILELANG_CACHE_DIR"], os.environ["FLASHRWKV2_CACHE_DIR"]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", type=shape_arg, nargs="*", default=None,
                   help="B,T,H,D speed shapes (default: the four anchor shapes)")
    p.add_argument("--check-only", action="store_true", help="accuracy check only, no timing")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--no-precompile", action="store_true")
    p.add_argument("--tune", action="store_true",
                   help="flashrwkv2's explicit tuning per speed shape (minutes when uncached)")
    p.add_argument("--budget", type=float, default=480, help="seconds for the whole run")
    p.add_argument("--precompile-timeout", type=float, default=240)
    p.add_argument("--check-timeout", type=float, default=120)
    p.add_argument("--shape-timeout", type=float, default=75)
    p.add_argument("--workers", type=int, default=None, help="parallel compiles (default: cores)")
    p.add_argument("--exec-backend", default=None,
                   help="TILELANG_EXECUTION_BACKEND for the kernels (tvm_ffi, cython, ...)")
    p.add_argument("--restore-cache", default=None,
                   help="a .tgz of TileLang + flashrwkv2 caches to unpack first, if it exists")
    p.add_argument("--save-cache", default=None,
                   help="write the TileLang + flashrwkv2 caches to this .tgz at the end")
    p.add_argument("--_worker", choices=("precompile", "check", "speed"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shapes = SHAPES if args.shapes is None else args.shapes

    if args._worker:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return {"precompile": worker_precompile, "check": worker_check,
                "speed": worker_speed}[args._worker](args)

    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"flashrwkv2_wkv7: cannot import {', '.join(missing)}: install the flashrwkv2 and "
              "apache-tvm-ffi wheels and the tilelang tree from .peer/ (see this file's "
              "docstring) and put them on PYTHONPATH", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("TILELANG_CACHE_DIR", "/tmp/tilelang_cache")
    env.setdefault("FLASHRWKV2_CACHE_DIR", "/tmp/flashrwkv2_cache")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.exec_backend:
        env["TILELANG_EXECUTION_BACKEND"] = args.exec_backend
    os.environ.update({k: env[k] for k in ("TILELANG_CACHE_DIR", "FLASHRWKV2_CACHE_DIR")})
    if args.restore_cache and os.path.exists(args.restore_cache):
        rc = subprocess.run(["tar", "-xzf", args.restore_cache, "-C", "/"]).returncode
        emit(case="cache-restored", impl=IMPL, file=args.restore_cache, rc=rc)

    t_start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - t_start)  # noqa: E731
    common = ["--shapes", *[",".join(map(str, s)) for s in args.shapes]]
    common += ["--tune"] if args.tune else []
    common += ["--workers", str(args.workers)] if args.workers else []
    status = 0
    phases = []
    if not args.no_precompile:
        phases.append(("precompile", common, args.precompile_timeout))
    if not args.skip_check:
        phases.append(("check", common, args.check_timeout))
    if not args.check_only:
        for s in args.shapes:
            one = ["--shapes", ",".join(map(str, s))] + (["--tune"] if args.tune else [])
            phases.append((f"speed {s}", one, args.shape_timeout * (4 if args.tune else 1)))
    for name, argv_w, limit in phases:
        if left() < 20:
            emit(case="phase-skipped", impl=IMPL, phase=name, reason="budget spent")
            continue
        mode = name.split()[0]
        rc = run_phase(name, ["--_worker", mode, *argv_w], min(limit, left()), env)
        if mode == "check" and rc != 0:
            status = 3
    dirs = [d for d in cache_dirs() if os.path.isdir(d)]
    if args.save_cache and dirs:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_cache)), exist_ok=True)
        subprocess.run(["tar", "-czf", args.save_cache, *dirs], check=False,
                       stderr=subprocess.DEVNULL)
        emit(case="cache-saved", impl=IMPL, file=args.save_cache, dirs=dirs,
             mib=round(os.path.getsize(args.save_cache) / 2**20, 1)
             if os.path.exists(args.save_cache) else None)
    return status


if __name__ == "__main__":
    sys.exit(main())
