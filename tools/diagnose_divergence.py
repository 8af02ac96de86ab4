"""Reproduce a diverging GPU training run and localise its first non-finite value.

Trains a config exactly as `lwm-jax train` builds it (`build_program`) on fresh uniformly random
tokens every step, keeps the parameters from before each step, and at the first non-finite loss
re-runs that step's forward with probes (`lwm_jax.diagnostics.nonfinite`). For the first layer
whose WKV output is non-finite it then follows the WKV state token by token (float32 `lax.scan`)
to tell "the state really grows" from "the kernel breaks", runs the whole model through the
`recurrent` WKV and under `fp32`, and writes what it found under `--out`:

  steps.jsonl          loss / grad_norm / finite per step
  taps.json            per-tap statistics of the failing forward
  state_norm.npz       ||S_t||_F per (t, batch, head) of the failing layer (float32 recurrence)
  wkv_inputs.npz       r, w, k, v, a, b of the worst (batch, head) pair, float32 [T, N]
  (--export DIR)       the last finite parameters as an HF checkpoint (DIR/hf) and the failing
                       batch (DIR/tokens.npy), for `tools/fla_forward_check.py`

Usage (GPU): python tools/diagnose_divergence.py --config configs/rwkv7-0.1b.yaml \
    --out $OUT precision=bf16-mixed train.batch_size=8 train.ctx_len=4096
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from lwm_jax.ops.wkv7.recurrent import _one_token
from lwm_jax.diagnostics.nonfinite import describe, first_nonfinite, probed_forward, tap_stats
from lwm_jax.models.rwkv7 import probe_model_fn
from lwm_jax.train.config import load_config
from lwm_jax.train.sharding import tokens_sharding
from lwm_jax.train.trainer import build_program

WKV_INPUTS = ("r", "w", "k", "v", "a_in", "b_in")


def state_norms(r, w, k, v, a, b):
    """||S_t||_F for every t of the float32 token recurrence: [T, B, H] (inputs [B, T, H, N])."""
    f = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # noqa: E731
    B, T, H, N = r.shape

    def step(S, xs):      # the op's own one-token step (lwm_jax.ops.wkv7.recurrent)
        S, _ = _one_token(S, *xs)
        return S, jnp.sqrt(jnp.sum(S * S, axis=(2, 3)))

    S0 = jnp.zeros((B, H, N, N), jnp.float32)
    _, norms = jax.lax.scan(step, S0, tuple(f(x) for x in (r, w, k, v, a, b)))
    return norms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export", default=None, help="directory for the HF export + batch")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = load_config(args.config, ["data.path=null", "data.tokenizer=byte", *args.overrides])
    prog = build_program(cfg)
    t, V = cfg.train, cfg.model.vocab_size
    state = prog.init_state()
    sh = tokens_sharding(prog.mesh)
    key = jax.random.PRNGKey(args.seed)
    log = open(os.path.join(args.out, "steps.jsonl"), "w")
    failing = None
    t0 = time.time()
    for step in range(args.steps):
        tokens = jax.device_put(jax.random.randint(jax.random.fold_in(key, step),
                                                   (t.batch_size, t.ctx_len + 1), 0, V), sh)
        before = jax.tree.map(jnp.copy, state.params)
        state, m = prog.train_step(state, tokens)
        m = {k: float(v) for k, v in m.items()}
        rec = {"step": step + 1, **m, "time_s": round(time.time() - t0, 2)}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(json.dumps(rec), flush=True)
        if not np.isfinite(m["loss"]) or m["finite"] == 0:
            failing = (step + 1, before, tokens)
            break
        del before
    if failing is None:
        print(f"no non-finite loss in {args.steps} steps")
        return
    fail_step, params, tokens = failing
    inputs = tokens[:, :-1]
    T = t.ctx_len
    stats = tap_stats(probe_model_fn(cfg.model, prog.policy, cfg.runtime), params, inputs)
    line = describe(stats, T)
    print(f"step {fail_step}: {line}", flush=True)
    with open(os.path.join(args.out, "taps.json"), "w") as f:
        json.dump({"step": fail_step, "summary": line,
                   "taps": [s.__dict__ for s in stats]}, f, indent=1)
    for s in stats:
        if s.name.endswith(("att/wkv_out", "att/wkv_state", "x_out")) or s.name == "logits":
            print(f"  {s.name:24s} nonfinite {s.nonfinite:10d} first_t {s.first_position} "
                  f"max|x| {s.max_abs:.4g}")

    # The layer of the first non-finite value: follow its WKV state token by token.
    bad = first_nonfinite(stats)
    layer = bad.name.split("/")[0] if bad is not None and bad.name.startswith("layer") else None
    if layer is not None:
        keep = {f"{layer}/att/{n}" for n in WKV_INPUTS}
        _, recs = probed_forward(probe_model_fn(cfg.model, prog.policy, cfg.runtime), params, inputs,
                                 reduce=lambda name, x: x if name in keep else None)
        got = {name.rsplit("/", 1)[1]: x for name, x in recs if name in keep}
        norms = np.asarray(state_norms(*(got[n] for n in WKV_INPUTS)))   # [T, B, H]
        np.savez_compressed(os.path.join(args.out, "state_norm.npz"), norms=norms[::8],
                            every=8)
        final = np.where(np.isfinite(norms[-1]), norms[-1], np.inf)
        bi, hi = np.unravel_index(np.argmax(final), final.shape)
        print(f"{layer}: float32 token recurrence, max ||S_t||_F over (b, h) at t = "
              + ", ".join(f"{tt}: {np.nanmax(norms[tt]):.3g}" for tt in
                          (31, 255, 1023, 2047, 3071, 3487, T - 1) if tt < T), flush=True)
        print(f"{layer}: worst pair b={bi} h={hi}; its norm at those t: "
              + ", ".join(f"{norms[tt, bi, hi]:.3g}" for tt in (255, 1023, 2047, 3071, T - 1)
                          if tt < T), flush=True)
        np.savez_compressed(os.path.join(args.out, "wkv_inputs.npz"), layer=layer, b=bi, h=hi,
                            **{n: np.asarray(got[n][bi, :, hi], np.float32)
                               for n in WKV_INPUTS})

    # The same parameters and batch through other WKV paths and policies.
    import dataclasses
    from flax import nnx
    from lwm_jax.models.rwkv7 import RWKV7
    from lwm_jax.precision import parse_policy
    for impl, pol in (("recurrent", prog.policy.name), ("pallas", "fp32"),
                      ("recurrent", "fp32")):
        rt = dataclasses.replace(cfg.runtime, wkv_impl=impl, remat=False, scan_layers=False)
        policy = parse_policy(pol)
        gd, _ = nnx.split(nnx.eval_shape(
            lambda: RWKV7(cfg.model, policy, runtime=rt, rngs=nnx.Rngs(0))))
        fwd = jax.jit(lambda p, x: jnp.isfinite(nnx.merge(gd, p)(x)).all(axis=(0, 2)))
        ok_t = np.asarray(fwd(params, inputs))
        first = None if ok_t.all() else int(np.argmin(ok_t))
        print(f"forward wkv_impl={impl} precision={pol}: first non-finite position {first}",
              flush=True)
    if args.export:
        from lwm_jax.interop import hf
        hf.write_hf(cfg.model.resolved(), jax.tree.map(np.asarray, params),
                    os.path.join(args.export, "hf"), dtype="f32")
        np.save(os.path.join(args.export, "tokens.npy"), np.asarray(inputs))


if __name__ == "__main__":
    main()
