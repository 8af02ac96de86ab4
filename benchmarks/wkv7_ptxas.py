"""Offline compile of the WKV7 GPU kernels for sm_90 (no GPU needed): `benchmarks/wkv7.py ptxas`.

    python3 benchmarks/wkv7.py ptxas --triton-site SITE [--shape B T H D --chunk C --tuning JSON
        --out DIR --no-xla-rounding]

Lowers one bf16 fwd+bwd of the op for CUDA (jaxlib <= 0.10.2 lowers Pallas-Triton calls
without compiling them), compiles each kernel's Triton IR with the `triton` wheel under SITE
(`pip install --target SITE triton==<the GPU machine's version>`) and prints, per kernel, the
registers and spills (`ptxas -v`), Triton's shared memory, the wgmma / mma.sync counts and the
SASS instruction count (`nvdisasm`). The files land in DIR (`benchmarks/ttir_lines.py` reads the
`.ttir` ones).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

_TF32_DOT = re.compile(r"^(\s*)(%\S+) = tt\.dot (%[^,]+), (%[^,]+), (%[^,]+), "
                       r"inputPrecision = tf32 : (tensor<[^>]*xf32>) \* (tensor<[^>]*xf32>)"
                       r" -> (.*)$")


def xla_tf32_rounding(ttir: str) -> str:
    """The Triton IR as XLA's Triton pipeline (jaxlib 0.11.2) hands it on: every float32 TF32
    `tt.dot` not marked `tf32_arguments_rounded` gets `cvt.rna.tf32.f32` on both operands
    (Triton's own pass then merges repeated roundings of one value). Without this the offline
    compile misses what costs the chunk kernels most instructions on the GPU
    (benchmarks/NOTES-wkv7.md, 2026-11-29)."""
    asm = ('"cvt.rna.tf32.f32 $0, $1;" {constraints = "=r,r", packed_element = 1 : i32, '
           'pure = true}')
    out = []
    for i, line in enumerate(ttir.splitlines()):
        m = _TF32_DOT.match(line)
        if not m:
            out.append(line)
            continue
        ind, res, a, b, acc, ta, tb, rest = m.groups()
        out += [f"{ind}%xla_rna_a{i} = tt.elementwise_inline_asm {asm} {a} : {ta} -> {ta}",
                f"{ind}%xla_rna_b{i} = tt.elementwise_inline_asm {asm} {b} : {tb} -> {tb}",
                f"{ind}{res} = tt.dot %xla_rna_a{i}, %xla_rna_b{i}, {acc}, inputPrecision = tf32"
                f" : {ta} * {tb} -> {rest}"]
    return "\n".join(out) + "\n"


def run(args, emit):
    """CPU only (jaxlib <= 0.10.2, which lowers Pallas-Triton calls without compiling them):
    lower one bf16 fwd+bwd for CUDA, compile each kernel's Triton IR with the `triton` wheel
    (--triton-site: a folder holding it, e.g. `pip install --target`) for sm_90 and print
    `ptxas -v` (registers, spills), Triton's shared memory, the wgmma / mma.sync counts and the
    SASS instruction count (`nvdisasm`). The IR first gets XLA's TF32 operand rounding
    (`xla_tf32_rounding`, unless --no-xla-rounding); `Tuning.round_tf32` defaults to True here
    (the kernels' own rounding, what the op does on sm_90). Triton's own pipeline links the
    libdevice calls (`exp`, `log`) here, XLA's does on the device: a change to those is not
    predicted by these counts (benchmarks/NOTES-wkv7.md, 2026-11-29). `benchmarks/ttir_lines.py`
    maps a written kernel's SASS instructions back to its TTIR lines and product operands."""
    import jax
    import jax.numpy as jnp
    from lwm_jax.ops.wkv7.pallas import Tuning, wkv7_gpu
    from lwm_jax.ops.wkv7.testing import lowered_triton_kernels
    os.makedirs(args.out, exist_ok=True)
    B, T, H, D = args.shape
    tune = Tuning(**{"round_tf32": True, **(json.loads(args.tuning) if args.tuning else {})})
    xs = [jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)] * 6

    def loss(xs):
        o, s = wkv7_gpu(*xs, None, None, args.chunk, None, tuning=tune)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
    kernels = [(k["ttir"], k["name"], k["num_warps"], k["num_stages"])
               for k in lowered_triton_kernels(jax.grad(loss), xs)]
    sys.path.insert(0, args.triton_site)
    import triton
    from triton.backends.compiler import GPUTarget
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    bindir = os.path.dirname(ptxas)
    for i, (ir, name, warps, stages) in enumerate(kernels):
        base = os.path.join(args.out, f"{i:02d}_{name}_w{warps}")
        with open(base + ".ttir", "w") as f:
            f.write(ir if args.no_xla_rounding else xla_tf32_rounding(ir))
        k = triton.compile(base + ".ttir", target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": int(warps), "num_stages": int(stages)})
        with open(base + ".ptx", "w") as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", base + ".ptx", "-o", base + ".cubin"],
                           capture_output=True, text=True)
        info = " ".join(l.split(":", 1)[-1].strip() for l in r.stderr.splitlines()
                        if "Used" in l or "spill" in l)
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", base + ".cubin"],
                              capture_output=True, text=True).stdout
        emit(case="ptxas", kernel=name, warps=int(warps), smem_bytes=k.metadata.shared,
             wgmma=k.asm["ptx"].count("wgmma.mma_async"), mma_sync=k.asm["ptx"].count("mma.sync"),
             sass_instructions=len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M)),
             info=info[:300])
