"""Where the train state's initialisation spends its time: trace, compile, run (twice).

`lwm-jax train` and `benchmarks/train_step.py` start by initialising the state on the device
(`TrainProgram.init_state`: one jitted program with the state's shardings as its outputs).
Before the batched-QR init it took longer than compiling the train step at 1.5B and above
(figures in benchmarks/RESULTS-log.md). This times each part of it for one model:

- `trace`: lowering the jitted init (building the model's modules on abstract values);
- `compile`: XLA's compile of it;
- `run 1` / `run 2`: executing it, the first time (one-time costs of the libraries it calls,
  e.g. solver handles) and again (the work itself);
- with `--profile DIR`: the second run under `jax.profiler`, and its top device ops
  (`profile_summary.py`);
- with `--qr`: each semi-orthogonal matrix shape of the RWKV-7 model alone (`init.orthogonal`:
  Gaussian + QR, the suspects), second of two runs: `[L, C, C]` (receptance, key, value),
  `[L, C, F]` (ChannelMix key), `[C, V]` (head), `[L, d, C]` (the LoRA up-projections).

    python benchmarks/init_time.py --model 1.5b [--set model.n_layer=4] [--profile $OUT/init] [--qr]

On a CPU only `run 1` of the trainer's own CPU path (the model built op by op, see
`lwm_jax/train/trainer.py`) is timed. One JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import MODELS, case_config  # noqa: E402  (the throughput bench's cases)


def _cholesky_qr2(key, shape):
    """A GEMM-based candidate for the same matrices, timed beside the QR: Q of a Gaussian
    `[..., big, small]` by two Cholesky-QR passes (Gram matrix, Cholesky, triangular solve;
    float32, IEEE products), and `max |QᵀQ - I|` (float32 Cholesky-QR2 needs a well-conditioned
    input: fine for tall Gaussians, not assured for square ones)."""
    import jax
    import jax.numpy as jnp

    *batch, m, n = shape
    x = jax.random.normal(key, (*batch, max(m, n), min(m, n)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    for _ in range(2):
        gram = jnp.einsum("...mi,...mj->...ij", x, x, precision=hi)
        chol = jnp.linalg.cholesky(gram)
        x = jax.lax.linalg.triangular_solve(chol, x, left_side=False, lower=True,
                                            transpose_a=True)
    err = jnp.einsum("...mi,...mj->...ij", x, x, precision=hi) - jnp.eye(x.shape[-1])
    return x, jnp.max(jnp.abs(err))


def qr_times(m) -> dict[str, float]:
    """Seconds per orthogonal matrix shape of an RWKV-7 config `m` (second of two runs), the
    library's QR and, as `chol2 <shape>`, `_cholesky_qr2` with its orthogonality error."""
    import functools

    import jax

    from lwm_jax.models.rwkv7 import init
    m = m.resolved()
    L, C, V = m.n_layer, m.n_embd, m.vocab_size
    shapes = {"L,C,C": (L, C, C), "L,C,F": (L, C, m.ffn_dim), "C,V": (C, V),
              "L,d,C": (L, max(m.decay_lora, m.a_lora, m.v_lora, m.gate_lora), C)}
    key, out = jax.random.PRNGKey(0), {}
    for name, shape in shapes.items():
        init.orthogonal(key, shape, 1.0)
        t = time.perf_counter()
        init.orthogonal(key, shape, 1.0)       # waits for its result outside a trace
        out[name] = round(time.perf_counter() - t, 3)
        print(f"STAGE qr {name} {out[name]} s", file=sys.stderr, flush=True)
        chol = jax.jit(functools.partial(_cholesky_qr2, shape=shape))
        jax.block_until_ready(chol(key))
        t = time.perf_counter()
        _, err = jax.block_until_ready(chol(key))
        out[f"chol2 {name}"] = [round(time.perf_counter() - t, 3), float(err)]
        print(f"STAGE chol2 {name} {out[f'chol2 {name}']}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.5b", choices=sorted(MODELS))
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="dotted config overrides (model.n_layer=4, mesh.fsdp=2, ...)")
    ap.add_argument("--profile", default=None, help="directory: profile the second run")
    ap.add_argument("--qr", action="store_true", help="also time each orthogonal matrix shape")
    ap.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = ap.parse_args()

    import jax

    from lwm_jax.train.params import count_params
    from lwm_jax.train.trainer import build_program

    row: dict = {"model": args.model, "overrides": args.set, "jax": jax.__version__,
                 "device": jax.local_devices()[0].device_kind, "devices": jax.device_count()}
    t0 = time.perf_counter()
    prog = build_program(case_config(args.model, args.precision, args.set))
    row["params"] = count_params(prog.abstract_state.params)
    row["build_s"] = round(time.perf_counter() - t0, 2)

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        row[name] = round(time.perf_counter() - t, 2)
        print(f"STAGE {name} {row[name]} s", file=sys.stderr, flush=True)
        return out

    if jax.default_backend() == "cpu":
        timed("run1_s", prog.init_state)
    else:
        init = jax.jit(prog.fresh_state, out_shardings=prog.state_sh)
        lowered = timed("trace_s", init.lower)
        compiled = timed("compile_s", lowered.compile)
        state = timed("run1_s", compiled)
        del state
        if args.profile:
            from profile_summary import top_ops

            from lwm_jax.train.profiling import trace
            os.makedirs(args.profile, exist_ok=True)
            with trace(args.profile):
                timed("run2_s", compiled)
            row["top_ops"] = top_ops(args.profile, n=15)
        else:
            timed("run2_s", compiled)
    if args.qr:
        row["qr_s"] = qr_times(prog.cfg.model)
    line = json.dumps(row)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
