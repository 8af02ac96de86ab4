"""Under FSDP the train step moves parameters between devices, never activations, and the
fused loss's chunk loop moves nothing at all.

`lwm_jax.layers.layout.pin_activation` pins the residual stream at every layer boundary. Without
it XLA partitioned the layer loop (no `lax.scan`) of RWKV-7, LLaMA and the hybrid by gathering
`[B, T, ...]` activations (channel-mix hidden states, logits) across the `fsdp` axis and
reduce-scattering results back, which doubled the 0.1B step on two H200s. The compiled step on a
2-device CPU mesh (`mesh.fsdp=2`) must hold no collective of a float `[B, T, ...]` array.

The fused loss (`lwm_jax.train.loss`) summed each chunk's head gradient over all devices'
tokens, so XLA reduced it (and, under FSDP, gathered the head) once per chunk; it now keeps one
accumulator per device. No collective may touch a `[.., C, V]` head array or a scalar inside a
loop of the compiled step (the layer scan's loop gathers its layer's parameters: allowed).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = textwrap.dedent("""
    import json, re, sys
    import jax, numpy as np
    from lwm_jax.train.config import load_config
    from lwm_jax.train.sharding import tokens_sharding
    from lwm_jax.train.trainer import build_program

    config, scan, mesh, B, T, V = sys.argv[1], sys.argv[2], sys.argv[3], 4, 64, 384
    data, fsdp, seq = mesh.split(",")
    cfg = load_config(config, [f"train.batch_size={B}", f"train.ctx_len={T}", f"mesh.data={data}",
                               f"mesh.fsdp={fsdp}", f"mesh.sequence={seq}",
                               f"runtime.scan_layers={scan}", "data.path=null",
                               "data.val_path=null", "precision=bf16-mixed",
                               f"model.vocab_size={V}", "train.loss_chunk=64"])
    prog = build_program(cfg)
    tokens = jax.ShapeDtypeStruct((B, T + 1), np.int32, sharding=tokens_sharding(prog.mesh))
    hlo = prog.train_step.lower(prog.abstract_state, tokens).compile().as_text()
    moved, in_loop = [], []
    kinds = "all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
    bodies = {b.lstrip("%") for b in re.findall(r"body=(%?[\\w.\\-]+)", hlo)}
    for comp in re.split(r"\\n(?=%|ENTRY)", hlo):
        looped = comp.split(" ", 1)[0].lstrip("%") in bodies
        for line in comp.splitlines():
            m = re.search(rf"= (.+?) ({kinds})(?:-start)?\\(", line)
            if not m:
                continue
            for dtype, dims in re.findall(r"(\\w+)\\[([\\d,]*)\\]", m.group(1)):  # tuples too
                shape = [int(d) for d in dims.split(",") if d]
                if dtype.startswith(("f", "bf")) and len(shape) >= 3 and shape[:2] == [B, T]:
                    moved.append(f"{m.group(2)} {dtype}{shape}")
                if looped and (shape == [] or V in shape):
                    in_loop.append(f"{m.group(2)} {dtype}{shape}")
    print(json.dumps({"moved": moved, "in_loop": in_loop,
                      "collectives": len(re.findall(kinds, hlo))}))
""")


def _compiled(env_of, config, scan, mesh, devices):
    env = env_of(devices, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DRIVER, f"{REPO}/configs/{config}.yaml", scan,
                           mesh], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["collectives"] > 0          # the mesh is really split
    return out


@pytest.mark.parametrize("config,scan", [("tiny", "false"), ("tiny", "true"),
                                         ("llama-tiny", "false"), ("llama-tiny", "true"),
                                         ("rwkv7-hybrid-tiny", "false")])  # (no hybrid scan)
def test_fsdp_step_moves_no_activations(config, scan, subprocess_env):
    out = _compiled(subprocess_env, config, scan, "1,2,1", 2)
    assert out["moved"] == [], out["moved"]
    assert out["in_loop"] == [], out["in_loop"]


@pytest.mark.parametrize("mesh", ["2,1,1", "1,2,2", "1,1,2"])   # data, fsdp, sequence
def test_fused_loss_loop_moves_nothing(mesh, subprocess_env):
    """Data parallel, FSDP x sequence, sequence alone (RWKV-7, layer scan)."""
    out = _compiled(subprocess_env, "tiny", "true", mesh, 2 if mesh != "1,2,2" else 4)
    assert out["in_loop"] == [], out["in_loop"]
