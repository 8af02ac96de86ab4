"""Name and shape tables between our parameter tree and the two external checkpoint layouts.

Our tree (`nnx.state(model, nnx.Param).to_pure_dict()` of `lwm_jax.models.rwkv7.RWKV7`, every leaf
float32) is addressed here by "/"-joined paths. Block parameters are stacked: a path under
`blocks/` holds an array with a leading `[L]` axis, and each external file stores one slice per
layer. Matrices in our tree use the `x @ W` layout `[C_in, C_out]`; torch `Linear.weight` is
`[C_out, C_in]`, so those are transposed on the way in and out.

A table row is `(our_path, external_name, kind)`; `kind` says how one layer's slice maps:
  "vec3"  external `[1, 1, C]`  <-> ours `[C]`
  "vec"   external `[C]`        <-> ours `[C]`
  "same"  identical shapes (LoRA matrices in the official layout, `r_k [H, N]`, norms)
  "lin"   external = oursᵀ (torch `Linear.weight`, and FLA's LoRA `nn.Linear`s)
On import every vector kind accepts any shape holding exactly C numbers (old files differ).
"""
from __future__ import annotations

import numpy as np

# ---- our tree -------------------------------------------------------------------------------
# Top-level (unstacked) leaves and block (stacked) leaves, with the kind of each in our tree.
TOP = {
    "emb": "emb",
    "ln0_w": "ln0/weight", "ln0_b": "ln0/bias",
    "ln_out_w": "ln_out/weight", "ln_out_b": "ln_out/bias",
    "head": "head",
}
ATT = "blocks/att/"
FFN = "blocks/ffn/"
BLK = "blocks/"

# ---- official RWKV-LM .pth (per layer i, prefix "blocks.{i}.") ------------------------------
OFFICIAL_TOP = [
    (TOP["emb"], "emb.weight", "same"),
    (TOP["ln0_w"], "blocks.0.ln0.weight", "vec"),
    (TOP["ln0_b"], "blocks.0.ln0.bias", "vec"),
    (TOP["ln_out_w"], "ln_out.weight", "vec"),
    (TOP["ln_out_b"], "ln_out.bias", "vec"),
    (TOP["head"], "head.weight", "lin"),
]
OFFICIAL_BLOCK = [
    (BLK + "ln1/weight", "ln1.weight", "vec"), (BLK + "ln1/bias", "ln1.bias", "vec"),
    (BLK + "ln2/weight", "ln2.weight", "vec"), (BLK + "ln2/bias", "ln2.bias", "vec"),
    *[(ATT + f"x_{m}", f"att.x_{m}", "vec3") for m in "rwkvag"],
    *[(ATT + f"{m}0", f"att.{m}0", "vec3") for m in "wav"],
    *[(ATT + f"{m}{j}", f"att.{m}{j}", "same") for m in "wavg" for j in (1, 2)],
    (ATT + "k_k", "att.k_k", "vec3"), (ATT + "k_a", "att.k_a", "vec3"),
    (ATT + "r_k", "att.r_k", "same"),
    *[(ATT + f"{n}", f"att.{n}.weight", "lin")
      for n in ("receptance", "key", "value", "output")],
    (ATT + "ln_x/weight", "att.ln_x.weight", "vec"), (ATT + "ln_x/bias", "att.ln_x.bias", "vec"),
    (FFN + "x_k", "ffn.x_k", "vec3"),
    (FFN + "key", "ffn.key.weight", "lin"), (FFN + "value", "ffn.value.weight", "lin"),
]
# Layer 0 never uses the value-residual mix; old files omit these three.
LAYER0_OPTIONAL = ("att.v0", "att.v1", "att.v2")

# ---- FLA / Hugging Face (per layer i, prefix "model.layers.{i}.") ---------------------------
HF_TOP = [
    (TOP["emb"], "model.embeddings.weight", "same"),
    (TOP["ln0_w"], "model.layers.0.pre_norm.weight", "vec"),
    (TOP["ln0_b"], "model.layers.0.pre_norm.bias", "vec"),
    (TOP["ln_out_w"], "model.norm.weight", "vec"),
    (TOP["ln_out_b"], "model.norm.bias", "vec"),
    (TOP["head"], "lm_head.weight", "lin"),
]
_HF_LORA = {"w": "w_lora", "a": "a_lora", "v": "v_lora", "g": "g_lora"}
HF_BLOCK = [
    (BLK + "ln1/weight", "attn_norm.weight", "vec"), (BLK + "ln1/bias", "attn_norm.bias", "vec"),
    (BLK + "ln2/weight", "ffn_norm.weight", "vec"), (BLK + "ln2/bias", "ffn_norm.bias", "vec"),
    *[(ATT + f"x_{m}", f"attn.x_{m}", "vec3") for m in "rwkvag"],
    # FLA's LoRA is Linear(C, D, no bias) -> act -> Linear(D, C, bias = x0): weights are x1ᵀ, x2ᵀ.
    *[(ATT + f"{m}0", f"attn.{_HF_LORA[m]}.lora.2.bias", "vec") for m in "wav"],
    *[(ATT + f"{m}1", f"attn.{_HF_LORA[m]}.lora.0.weight", "lin") for m in "wavg"],
    *[(ATT + f"{m}2", f"attn.{_HF_LORA[m]}.lora.2.weight", "lin") for m in "wavg"],
    (ATT + "k_k", "attn.k_k", "vec"), (ATT + "k_a", "attn.k_a", "vec"),
    (ATT + "r_k", "attn.r_k", "same"),
    *[(ATT + f"{ours}", f"attn.{hf}.weight", "lin")
      for ours, hf in (("receptance", "r_proj"), ("key", "k_proj"), ("value", "v_proj"),
                       ("output", "o_proj"))],
    (ATT + "ln_x/weight", "attn.g_norm.weight", "vec"), (ATT + "ln_x/bias", "attn.g_norm.bias", "vec"),
    (FFN + "x_k", "ffn.x_k", "vec"),
    (FFN + "key", "ffn.key.weight", "lin"), (FFN + "value", "ffn.value.weight", "lin"),
]
# FLA builds no v_lora in layer 0.
HF_LAYER0_ABSENT = tuple(f"attn.v_lora.lora.{s}" for s in ("0.weight", "2.weight", "2.bias"))
# FLA checkpoints from early 2025 stored the six token-shift mixes as one `attn.x_x [6, C]`.
HF_FUSED_MIX = ("attn.x_x", "rwkvag")


def to_external(x: np.ndarray, kind: str) -> np.ndarray:
    """One layer's slice of our leaf -> the external tensor (kinds: see module docstring)."""
    if kind == "vec3":
        return x.reshape(1, 1, -1)
    if kind == "lin":
        return np.ascontiguousarray(x.T)
    return x


def from_external(x: np.ndarray, kind: str, expected: tuple[int, ...], name: str) -> np.ndarray:
    """External tensor -> one layer's slice of our leaf, checked against `expected` (our shape).

    Raises ValueError naming the tensor when the shape cannot be mapped.
    """
    if kind in ("vec3", "vec"):
        if x.size != int(np.prod(expected)):
            raise ValueError(f"checkpoint tensor {name}: shape {tuple(x.shape)} does not hold "
                             f"{expected[0]} values (expected [{expected[0]}] or [1, 1, {expected[0]}])")
        return x.reshape(expected)
    y = x.T if kind == "lin" else x
    if tuple(y.shape) != tuple(expected):
        want = expected[::-1] if kind == "lin" else expected
        raise ValueError(f"checkpoint tensor {name}: shape {tuple(x.shape)}, expected "
                         f"{tuple(want)} for this model's config")
    return y


def get_path(tree: dict, path: str):
    node = tree
    for part in path.split("/"):
        node = node[part]
    return node


def set_path(tree: dict, path: str, value) -> None:
    parts = path.split("/")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
