"""How a model runs, as opposed to what it computes: shared by every model family.

`Runtime` holds the knobs that change speed and memory but not the math or the parameter tree:
which WKV7 implementation runs, its chunk length, activation rematerialisation and whether the
layers are iterated with `lax.scan`. A model is built from its architecture config (e.g.
`lwm_jax.models.rwkv7.config.ModelConfig`), a precision `Policy` and a `Runtime`; a run config
carries it as its `runtime:` section. Imports nothing heavy (no jax).
"""
from __future__ import annotations

import dataclasses

WKV_IMPLS = ("auto", "pallas", "chunked", "recurrent")
KERNEL_IMPLS = ("auto", "xla", "pallas", "interpret")   # = lwm_jax.ops.kernel_choice.IMPLS
REMAT_POLICIES = ("full", "save_dots")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Execution knobs of a model (no effect on its math or parameters).

    Attributes:
      wkv_impl: WKV7 implementation ("auto" = Pallas kernel on GPU/TPU, chunked XLA on CPU).
      chunk_size: chunk length for the chunked and Pallas WKV7; 0 = the implementation's
        default (Pallas: 32 on GPU, 64 on TPU; chunked XLA: 64).
      remat: wrap each block in `jax.checkpoint` (recompute activations in the backward pass).
      remat_policy: what a remat'd block keeps from its forward (only read when `remat`):
        "full" keeps nothing but the block's inputs and recomputes the whole block in the
        backward (least memory); "save_dots" keeps the outputs of the block's matmuls (as
        `Policy.einsum` returns them: bf16 under bf16-mixed, not the float32 accumulator) and of
        the WKV op with the WKV kernels' saved-for-backward arrays, and recomputes only the
        elementwise work between them (no matmul or WKV kernel runs twice; more memory).
      remat_layers: how many blocks `remat` applies to, counted from the first; the later
        blocks keep their activations as without remat. -1 (default) = every block. Each
        unrematerialised block trades its recompute time for its activation memory: the knob
        that spends a GPU's spare memory on speed (numbers in benchmarks/RESULTS.md).
      scan_layers: iterate the (always stacked) block parameters with `lax.scan` instead of a
        Python loop; a compile-time saver at 24+ layers. The parameter tree is the same either way.
      ln_x_impl: the backward of RWKV-7's `ln_x` GroupNorm, the `impl` of
        `lwm_jax.ops.group_norm.group_norm`: "xla" (autodiff of the forward), "pallas" (one
        kernel), "interpret" (that kernel in the Pallas interpreter, for tests) or "auto":
        "pallas" on one GPU when the shape allows it, else "xla". The forward is the same
        either way. Memory and time of each: benchmarks/RESULTS.md.
      ffn_impl: RWKV-7 ChannelMix's `relu(x W_key)² W_value`, the `impl` of
        `lwm_jax.ops.squared_relu_mlp.squared_relu_mlp`: "xla" (`Policy.einsum` products and a
        separate square), "pallas" (the square in the key GEMM's epilogue, its gradient in the
        value weight's input-gradient GEMM), "interpret" (those kernels interpreted, for tests)
        or "auto": "pallas" on one GPU under a bf16 compute dtype when the shapes tile, else
        "xla". Same math; the kernels round each result once from float32
        (benchmarks/RESULTS.md).
      norm_impl: RWKV-7's block LayerNorms (`ln1`, `ln2`), the `impl` of
        `lwm_jax.ops.layer_norm.layer_norm`: "xla" (autodiff for the backward), "pallas" (one
        kernel each way over the transposed activations), "interpret" (for tests) or "auto":
        "pallas" on one GPU under a bf16 compute dtype when tokens and channels tile and the
        model is at least `ops.layer_norm.AUTO_MIN_CHANNELS` wide, else "xla" (where the
        kernels measured faster: benchmarks/RESULTS.md).
      On a device mesh that splits only the batch and the sequence "auto" and "pallas" run the
      three kernels per device (`lwm_jax.ops.kernel_choice.on_each_device`; "auto" by the
      one-GPU rule above, on each device's share, and not under FSDP, where it is unmeasured);
      with a tensor axis "auto" keeps XLA's forms and "pallas" is refused.
    """

    wkv_impl: str = "auto"
    chunk_size: int = 0
    remat: bool = False
    remat_policy: str = "full"
    remat_layers: int = -1
    scan_layers: bool = False
    ln_x_impl: str = "auto"
    ffn_impl: str = "auto"
    norm_impl: str = "auto"

    def __post_init__(self):
        def bad(field, msg):
            raise ValueError(f"runtime.{field}: {msg}")
        if self.wkv_impl not in WKV_IMPLS:
            bad("wkv_impl", f"{self.wkv_impl!r} is not one of {WKV_IMPLS}")
        for f in ("ln_x_impl", "ffn_impl", "norm_impl"):
            if getattr(self, f) not in KERNEL_IMPLS:
                bad(f, f"{getattr(self, f)!r} is not one of {KERNEL_IMPLS}")
        c = self.chunk_size
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            bad("chunk_size", f"must be an integer >= 0 (0 = the implementation's default), "
                              f"got {c!r}")
        if self.remat_policy not in REMAT_POLICIES:
            bad("remat_policy", f"{self.remat_policy!r} is not one of {REMAT_POLICIES}")
        for f in ("remat", "scan_layers"):
            if not isinstance(getattr(self, f), bool):
                bad(f, f"must be true or false, got {getattr(self, f)!r}")
        n = self.remat_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < -1:
            bad("remat_layers", f"must be -1 (every block) or a number of blocks >= 0, got {n!r}")

    def rematerialized(self, layer: int) -> bool:
        """Whether block `layer` (0-based) runs under `jax.checkpoint`."""
        return self.remat and (self.remat_layers < 0 or layer < self.remat_layers)

    def remat_runs(self, start: int, stop: int) -> list[tuple[int, int, bool]]:
        """Blocks `start..stop-1` as `(first, end, rematerialized)` runs of consecutive blocks
        with the same remat (one `lax.scan` each when `scan_layers`; two runs at most)."""
        runs: list[tuple[int, int, bool]] = []
        for layer in range(start, stop):
            remat = self.rematerialized(layer)
            if runs and runs[-1][2] == remat:
                runs[-1] = (runs[-1][0], layer + 1, remat)
            else:
                runs.append((layer, layer + 1, remat))
        return runs


RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(Runtime))

