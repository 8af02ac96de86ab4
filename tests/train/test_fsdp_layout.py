"""Under FSDP the train step moves parameters between devices, never activations.

`lwm_jax.layers.layout.pin_activation` pins the residual stream at every layer boundary. Without
it XLA partitioned the layer loop (no `lax.scan`) of RWKV-7, LLaMA and the hybrid by gathering
`[B, T, ...]` activations (channel-mix hidden states, logits) across the `fsdp` axis and
reduce-scattering results back, which doubled the 0.1B step on two H200s. The compiled step on a
2-device CPU mesh (`mesh.fsdp=2`) must hold no collective of a float `[B, T, ...]` array.
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

    config, scan, B, T = sys.argv[1], sys.argv[2], 4, 64
    cfg = load_config(config, [f"train.batch_size={B}", f"train.ctx_len={T}", "mesh.data=1",
                               "mesh.fsdp=2", f"runtime.scan_layers={scan}", "data.path=null",
                               "data.val_path=null", "precision=bf16-mixed"])
    prog = build_program(cfg)
    tokens = jax.ShapeDtypeStruct((B, T + 1), np.int32, sharding=tokens_sharding(prog.mesh))
    hlo = prog.train_step.lower(prog.abstract_state, tokens).compile().as_text()
    moved = []
    kinds = "all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
    for line in hlo.splitlines():
        m = re.search(rf"= (.+?) ({kinds})(?:-start)?\\(", line)
        if m:   # a tuple result lists several arrays
            for dtype, dims in re.findall(r"(\\w+)\\[([\\d,]*)\\]", m.group(1)):
                shape = [int(d) for d in dims.split(",") if d]
                if dtype.startswith(("f", "bf")) and len(shape) >= 3 and shape[:2] == [B, T]:
                    moved.append(f"{m.group(2)} {dtype}{shape}")
    print(json.dumps({"moved": moved, "collectives": len(re.findall(kinds, hlo))}))
""")


@pytest.mark.parametrize("config", ["tiny", "llama-tiny", "rwkv7-hybrid-tiny"])
@pytest.mark.parametrize("scan", ["false", "true"])
def test_fsdp_step_moves_no_activations(config, scan):
    if config == "rwkv7-hybrid-tiny" and scan == "true":
        pytest.skip("the hybrid has no layer scan")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, f"{REPO}/configs/{config}.yaml", scan],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["collectives"] > 0          # parameters are gathered: the mesh is really split
    assert out["moved"] == [], out["moved"]
