"""Run FLA's `RWKV7ForCausalLM` on an exported checkpoint and batch; report non-finite logits.

The peer half of `tools/diagnose_divergence.py` (a separate process: torch and JAX should not
share the GPU's memory). Needs torch, transformers and FLA on a CUDA GPU.

Usage: python tools/fla_forward_check.py DIR     (DIR/hf and DIR/tokens.npy)
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from fla.models import RWKV7ForCausalLM


def first_bad(logits) -> int | None:
    ok_t = torch.isfinite(logits).all(dim=0).all(dim=-1).cpu().numpy()
    return None if ok_t.all() else int(np.argmin(ok_t))


def main() -> None:
    root = sys.argv[1]
    tokens = torch.as_tensor(np.load(f"{root}/tokens.npy"), dtype=torch.long, device="cuda")
    model = RWKV7ForCausalLM.from_pretrained(f"{root}/hf", torch_dtype=torch.float32).cuda()
    model.eval()
    for name, ctx in (("fp32 params, fp32", torch.autocast("cuda", enabled=False)),
                      ("fp32 params, bf16 autocast", torch.autocast("cuda", torch.bfloat16))):
        with torch.no_grad(), ctx:
            bad = []
            for i in range(tokens.shape[0]):   # one row at a time: [T, V] logits per call
                logits = model(input_ids=tokens[i:i + 1]).logits.float()
                bad.append(first_bad(logits))
        print(f"FLA {name}: first non-finite logit position per batch row: {bad}", flush=True)


if __name__ == "__main__":
    main()
