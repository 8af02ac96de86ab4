"""Loss-curve parity with FLA: the same 0.1B weights, batches, schedule and AdamW on both sides.

Three steps (the GPU ones may be separate device calls on the same GPU kind; loss curves do not
depend on timing):

    # 1. here (CPU): the batches, World-tokenised embedded corpus, as uint16 [steps, B, T + 1]
    python benchmarks/train_parity.py data --out .peer/parity --steps 300 --batch 8 --ctx 4096
    # 2. GPU: ours (writes the initial weights as an HF checkpoint for FLA, then trains)
    python benchmarks/train_parity.py ours --data .peer/parity --precision bf16-mixed \
        --init-hf /tmp/parity/init_hf --out $OUT/ours_bf16.jsonl
    python benchmarks/train_parity.py ours --data .peer/parity --precision fp32 --out $OUT/ours_fp32.jsonl
    #    GPU: FLA from the same weights (fp32 params + bf16 autocast), same batches
    python benchmarks/peers/fla_train_parity.py --data .peer/parity --init-hf /tmp/parity/init_hf \
        --out $OUT/fla_amp.jsonl
    #    random tokens instead of text (the NaN recipe): add --random-tokens to `ours`
    # 3. anywhere: the table every 25 steps and the PNG
    python benchmarks/train_parity.py report --runs ours_bf16.jsonl fla_amp.jsonl ... --png out.png

Recipe on both sides (configs/rwkv7-0.1b.yaml): AdamW betas (0.9, 0.99), eps 1e-18, weight
decay 1e-3 on projection / embedding / head matrices only, w0 at 2x lr, global-norm clip 1.0,
lr 6e-4 -> 6e-5 cosine over the run after a 10-step warm-up (multiplier 0.01 + 0.99 step/10),
cross-entropy + L2Wrap (1e-4 x max logit on each position's argmax), no data shuffling beyond
the fixed windows. Each JSONL line: {"step", "loss", "grad_norm"} (loss before the update).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

PARITY_OVERRIDES = ["data.path=null", "data.tokenizer=byte", "train.warmup_steps=10",
                    "train.lr=6e-4", "train.min_lr=6e-5", "train.l2wrap=true"]


def make_data(args) -> None:
    """World-tokenise the embedded corpus (documents joined by token 0) and cut fixed windows."""
    from lwm_jax.data import stdlib_corpus
    from lwm_jax.tokenizers import get_tokenizer
    tok = get_tokenizer("world")
    train, _ = stdlib_corpus()
    docs = bytes(np.asarray(train)).split(b"\x00")
    ids = []
    for doc in docs:
        if doc:
            ids.extend(tok.encode_bytes(doc))
            ids.append(0)
    ids = np.asarray(ids, np.uint16)
    rng = np.random.default_rng(args.seed)
    n = args.steps * args.batch
    starts = rng.integers(0, len(ids) - args.ctx - 1, n)
    windows = np.stack([ids[s:s + args.ctx + 1] for s in starts]).reshape(
        args.steps, args.batch, args.ctx + 1)
    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, "batches.npy"), windows)
    print(f"{len(ids):,} World tokens from {len(docs):,} documents; batches {windows.shape} "
          f"-> {args.out}/batches.npy")


def write_init(args) -> None:
    """Only the initial weights (HF format) of the config, as `ours --init-hf` writes them."""
    import jax
    from lwm_jax.interop import hf
    from lwm_jax.train.config import load_config
    from lwm_jax.train.trainer import build_program
    cfg = load_config(args.config, [*PARITY_OVERRIDES, *args.overrides])
    state = build_program(cfg).init_state()
    hf.write_hf(cfg.model.resolved(), jax.tree.map(np.asarray, state.params), args.init_hf,
                dtype="f32")
    print(f"initial weights -> {args.init_hf}", flush=True)


def run_ours(args) -> None:
    import jax
    import jax.numpy as jnp
    from lwm_jax.train.config import load_config
    from lwm_jax.train.sharding import tokens_sharding
    from lwm_jax.train.trainer import build_program

    batches = np.load(os.path.join(args.data, "batches.npy"))
    steps, B, T1 = batches.shape
    steps = min(steps, args.steps) if args.steps else steps
    cfg = load_config(args.config, [*PARITY_OVERRIDES, f"precision={args.precision}",
                                    f"train.batch_size={B}", f"train.ctx_len={T1 - 1}",
                                    f"train.steps={steps}", *args.overrides])
    prog = build_program(cfg)
    state = prog.init_state()
    if args.init_hf:
        from lwm_jax.interop import hf
        hf.write_hf(cfg.model.resolved(), jax.tree.map(np.asarray, state.params), args.init_hf,
                    dtype="f32")
        print(f"initial weights -> {args.init_hf}", flush=True)
    sh = tokens_sharding(prog.mesh)
    V = cfg.model.vocab_size
    key = jax.random.PRNGKey(1)
    t0 = time.time()
    with open(args.out, "w") as f:
        for i in range(steps):
            if args.random_tokens:
                tokens = jax.random.randint(jax.random.fold_in(key, i), (B, T1), 0, V)
            else:
                tokens = jnp.asarray(batches[i].astype(np.int32))
            state, m = prog.train_step(state, jax.device_put(tokens, sh))
            rec = {"step": i + 1, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                   "skipped_steps": int(m["skipped_steps"]), "time_s": round(time.time() - t0, 1)}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if (i + 1) % 25 == 0 or i == 0:
                print(json.dumps(rec), flush=True)


def _read(path):
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, f) if r.get("loss") is not None}


def report(args) -> None:
    runs = {os.path.splitext(os.path.basename(p))[0]: _read(p) for p in args.runs}
    names = list(runs)
    last = max(max(r) for r in runs.values())
    header = "| step | " + " | ".join(names) + " |"
    rows = [header, "|---:|" + "---:|" * len(names)]
    for step in [1] + list(range(args.every, last + 1, args.every)):
        cells = [f"{runs[n][step]['loss']:.4f}" if step in runs[n] else "–" for n in names]
        rows.append(f"| {step} | " + " | ".join(cells) + " |")
    print("\n".join(rows))
    if args.reference and args.reference in runs:
        ref = runs[args.reference]
        for n in names:
            if n == args.reference:
                continue
            gaps = [abs(runs[n][s]["loss"] / ref[s]["loss"] - 1) for s in ref
                    if s > 50 and s in runs[n] and s % args.every == 0]
            if gaps:
                print(f"{n} vs {args.reference}: largest relative gap after step 50 at logged "
                      f"steps {max(gaps):.2%}")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for n in names:
            s = sorted(runs[n])
            ax.plot(s, [runs[n][k]["loss"] for k in s], label=n, linewidth=1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("train loss (nats/token)")
        ax.set_title(args.title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"plot -> {args.png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--ctx", type=int, default=4096)
    d.add_argument("--seed", type=int, default=0)
    o = sub.add_parser("ours")
    o.add_argument("--data", required=True)
    o.add_argument("--config", default="configs/rwkv7-0.1b.yaml")
    o.add_argument("--precision", default="bf16-mixed")
    o.add_argument("--steps", type=int, default=0, help="0 = every batch in the data")
    o.add_argument("--init-hf", default=None, help="write the initial weights here (HF format)")
    o.add_argument("--random-tokens", action="store_true")
    o.add_argument("--out", required=True)
    o.add_argument("overrides", nargs="*")
    i = sub.add_parser("init")
    i.add_argument("--config", default="configs/rwkv7-0.1b.yaml")
    i.add_argument("--init-hf", required=True)
    i.add_argument("overrides", nargs="*")
    r = sub.add_parser("report")
    r.add_argument("--runs", nargs="+", required=True)
    r.add_argument("--every", type=int, default=25)
    r.add_argument("--reference", default=None, help="run name to measure the others against")
    r.add_argument("--png", default=None)
    r.add_argument("--title", default="RWKV-7 0.1B, ctx 4096, batch 8: train loss")
    args = ap.parse_args()
    {"data": make_data, "ours": run_ours, "init": write_init, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
