"""The train step's optimizer part alone: clip + AdamW + the non-finite guard, ms per update.

Builds the real optimizer of a config (`build_program`: RWKV-LM's parameter groups, float32
moments) with the real parameter shapes, then times three ways of guarding the update on
random float32 gradients, each jitted alone with parameters and moments donated (as the train
step donates its state):

- `inside`: the train step's form: one gradient norm for the clip, the metric and the check;
  the guard folded into the update (`apply=finite`, the learning rate 0 where not finite;
  `lwm_jax.train.optimizer.guarded_update`, which the step calls);
- `select`: the form before 2026-11-26: an all-finite reduction, the update (its clip computing
  the norm again), then `where(finite, new, old)` on every leaf;
- `cond`: `lax.cond(finite, update, keep)`;
- `none`: the update with no guard (the floor the guard is measured against).

Each also computes the gradient's global norm (a metric of the step). Prints one JSON line per
variant: median and minimum ms over `--reps` updates, and the bytes per parameter the median
implies at `--hbm-tbs` (the GPU's memory bandwidth, TB/s; 3.35 for an H100 SXM).

    python3 benchmarks/optimizer_update.py --model 1.5b      # on the device
    python3 benchmarks/optimizer_update.py --model tiny      # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1.5b")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hbm-tbs", type=float, default=3.35)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    from train_step import case_config
    from lwm_jax.precision.loss_scale import all_finite
    from lwm_jax.train.optimizer import guarded_update
    from lwm_jax.train.params import count_params
    from lwm_jax.train.trainer import build_program

    prog = build_program(case_config(args.model, "bf16-mixed", ["runtime.scan_layers=false"]))
    state = prog.init_state()
    leaves = jax.tree.leaves(state.params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    grads = jax.tree.unflatten(jax.tree.structure(state.params),
                               [1e-3 * jax.random.normal(k, p.shape, jnp.float32)
                                for k, p in zip(keys, leaves)])
    n_params = count_params(state.params)

    def update(params, opt_state, g, step):
        updates, opt_state = prog.tx.update(g, opt_state, params, lr=prog.lr_at(step))
        return optax.apply_updates(params, updates), opt_state

    def inside(params, opt_state, g, step):
        params, opt_state, norm, _ = guarded_update(prog.tx, g, opt_state, params,
                                                    prog.lr_at(step))
        return params, opt_state, norm

    def select(params, opt_state, g, step):
        finite = all_finite(g)
        new_params, new_opt = update(params, opt_state, g, step)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt, opt_state), optax.tree.norm(g)

    def cond(params, opt_state, g, step):
        new_params, new_opt = jax.lax.cond(all_finite(g),
                                           lambda: update(params, opt_state, g, step),
                                           lambda: (params, opt_state))
        return new_params, new_opt, optax.tree.norm(g)

    def none(params, opt_state, g, step):
        return (*update(params, opt_state, g, step), optax.tree.norm(g))

    params, opt_state = state.params, state.opt_state
    step = jnp.int32(5)
    variants = (("inside", inside), ("select", select), ("cond", cond), ("none", none),
                ("inside", inside))
    for name, fn in variants:
        jitted = jax.jit(fn, donate_argnums=(0, 1))
        params, opt_state, _ = jax.block_until_ready(jitted(params, opt_state, grads, step))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            params, opt_state, _ = jax.block_until_ready(jitted(params, opt_state, grads, step))
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        median = times[len(times) // 2]
        print(json.dumps({"model": args.model, "variant": name, "params": n_params,
                          "device": jax.devices()[0].device_kind, "median_ms": round(median, 3),
                          "min_ms": round(times[0], 3),
                          "bytes_per_param": round(median * 1e-3 * args.hbm_tbs * 1e12
                                                   / n_params, 1)}), flush=True)


if __name__ == "__main__":
    main()
