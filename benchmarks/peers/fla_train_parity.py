"""FLA side of `benchmarks/train_parity.py`: FLA's `RWKV7ForCausalLM` trained from our initial
weights on the same batches with the same recipe (see that file's docstring).

fp32 parameters + bf16 autocast for the model body (FLA's usual mixed precision); the head and
the loss in fp32 as ours (logits island), cross-entropy + L2Wrap, AdamW with RWKV-LM's groups.
Needs torch, transformers and FLA (`fla-core`, `flash-linear-attention`) on a CUDA GPU.

    python benchmarks/peers/fla_train_parity.py --data .peer/parity --init-hf /tmp/parity/init_hf \
        --out fla_amp.jsonl [--steps 300] [--random-tokens]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from fla.models import RWKV7ForCausalLM

L2WRAP_FACTOR = 1e-4


class L2Wrap(torch.autograd.Function):
    """Identity on the loss; its backward adds factor * max_logit / (B*T) at each argmax."""

    @staticmethod
    def forward(ctx, loss, logits):
        ctx.save_for_backward(logits)
        return loss

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        top, idx = torch.max(logits, dim=-1, keepdim=True)
        extra = torch.zeros_like(logits)
        extra.scatter_(-1, idx, top * (L2WRAP_FACTOR / (logits.shape[0] * logits.shape[1])))
        return grad, extra * grad


def lr_at(step: int, steps: int, lr=6e-4, min_lr=6e-5, warmup=10) -> float:
    """Same schedule as lwm_jax.train.optimizer.lr_schedule (step is 0-based)."""
    ratio = min_lr / lr
    progress = min(max((step - warmup) / max(1, steps - warmup), 0.0), 1.0)
    mult = (0.5 + ratio / 2) + (0.5 - ratio / 2) * math.cos(math.pi * progress)
    if step < warmup:
        mult *= 0.01 + 0.99 * step / warmup
    return lr * mult


def param_groups(model):
    """RWKV-LM groups: decay 1e-3 on >= 2-D `.weight` matrices outside the LoRAs; w0 at 2x lr."""
    decay, plain, w0 = [], [], []
    for name, p in model.named_parameters():
        if name.endswith("attn.w_lora.lora.2.bias"):
            w0.append(p)
        elif name.endswith(".weight") and p.ndim >= 2 and "lora" not in name:
            decay.append(p)
        else:
            plain.append(p)
    return [{"params": decay, "weight_decay": 1e-3, "mult": 1.0},
            {"params": plain, "weight_decay": 0.0, "mult": 1.0},
            {"params": w0, "weight_decay": 0.0, "mult": 2.0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--init-hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--random-tokens", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = np.load(os.path.join(args.data, "batches.npy"))
    steps = min(len(batches), args.steps) if args.steps else len(batches)
    model = RWKV7ForCausalLM.from_pretrained(args.init_hf, torch_dtype=torch.float32).cuda()
    model.train()
    V = model.config.vocab_size
    opt = torch.optim.AdamW(param_groups(model), lr=0.0, betas=(0.9, 0.99), eps=1e-18)
    gen = torch.Generator(device="cuda").manual_seed(1)
    t0 = time.time()
    with open(args.out, "w") as f:
        for i in range(steps):
            if args.random_tokens:
                tokens = torch.randint(0, V, batches.shape[1:], device="cuda", generator=gen)
            else:
                tokens = torch.as_tensor(batches[i].astype(np.int64), device="cuda")
            x, y = tokens[:, :-1], tokens[:, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden = model.model(input_ids=x).last_hidden_state
            logits = model.lm_head(hidden.float())                     # fp32 head and loss
            loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
            L2Wrap.apply(loss, logits).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr = lr_at(i, steps)
            for g in opt.param_groups:
                g["lr"] = lr * g["mult"]
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = {"step": i + 1, "loss": float(loss.detach()), "grad_norm": float(grad_norm),
                   "time_s": round(time.time() - t0, 1)}
            f.write(json.dumps(rec if math.isfinite(rec["loss"]) else {**rec, "loss": None})
                    + "\n")
            f.flush()
            if (i + 1) % 25 == 0 or i == 0:
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
