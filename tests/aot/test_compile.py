"""`lwm-jax compile` and what it stands on: every model family compiled by the real TPU compiler
(libtpu on this CPU host, no TPU) takes the TPU kernels because the platform follows the mesh's
devices; the per-chip plan of a shipped config on a pod slice; a step too large for a chip as
one line; multi-slice meshes; a compiled step saved and loaded by `train --compiled`, and every
mismatch refused in one line."""
import json
import os
import subprocess
import sys

import jax
import pytest

from lwm_jax.aot import testing as tpu
from lwm_jax.aot.plan import compile_plan
from lwm_jax.train.saved_step import check_header, read_header
from lwm_jax.aot.topology import parse_topology, topology_devices
from lwm_jax.train.config import load_config

pytestmark = pytest.mark.tpu_compile
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("LWM_DEBUG", "LWM_JAX_DEBUG")}
    return subprocess.run([sys.executable, "-m", "lwm_jax.cli", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, env=env, timeout=900)


# (config, overrides, topology): tiny models of each family, small batches, bf16 where the
# attention kernel needs it. Each program's Mosaic kernels are counted in the compiled HLO.
# Two layers each (the hybrid: one RWKV-7 and one attention layer): the kernels are counted per
# layer, so two show a missing kernel as well as four, and every layer is one more compile.
FAMILIES = [
    ("configs/tiny.yaml", ["model.n_layer=2"], "v4-8", "rwkv7"),
    ("configs/llama-tiny.yaml", ["precision=bf16-mixed", "model.n_layer=2"], "v6e-4", "llama"),
    ("configs/rwkv7-hybrid-tiny.yaml", ["precision=bf16-mixed", "model.n_layer=2",
                                        "model.attention_layers=[1]"], "v5litepod-4", "hybrid"),
]


@pytest.mark.slow
@pytest.mark.parametrize("config,overrides,topology,family", FAMILIES)
def test_each_model_family_compiles_for_tpu_with_its_kernels(config, overrides, topology,
                                                             family, record_property):
    cfg = load_config(os.path.join(ROOT, config), ["train.batch_size=8", *overrides],
                      data_files=False)
    assert jax.default_backend() == "cpu"          # the host; the mesh's devices are TPUs
    plan = compile_plan(cfg, topology_devices(topology), target=topology, with_eval=False)
    calls = tpu.mosaic_calls(plan.train.compiled)
    L = cfg.model.n_layer
    n_attention = len(getattr(cfg.model, "attention_layers", ()) or ()) if family == "hybrid" \
        else (L if family == "llama" else 0)
    wkv_layers = L - n_attention if family != "llama" else 0
    # per WKV layer a forward (saving states) and a backward kernel; per attention layer the
    # splash forward, dQ and dK/dV kernels
    assert len(calls) == 2 * wkv_layers + 3 * n_attention, (family, len(calls))
    assert plan.fits() and plan.platform == "tpu" and plan.estimate is not None
    generation = parse_topology(topology).jax_name.split(":")[0]      # v5litepod-4 -> v5e
    tpu.report(record_property, generation, f"{config} train step", plan.train.compiled,
               plan.train.compile_s)


@pytest.mark.slow
def test_two_slices_put_the_data_axis_across_them(record_property):
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"),               # 2 layers: see FAMILIES
                      ["train.batch_size=16", "mesh.data=2", "mesh.fsdp=-1", "model.n_layer=2"],
                      data_files=False)
    devices = topology_devices("v5p-8", num_slices=2)
    plan = compile_plan(cfg, devices, target="v5p-8", with_eval=False)
    assert plan.slices == 2 and plan.mesh == {"data": 2, "fsdp": 4, "tensor": 1, "sequence": 1}
    grid = plan.program.mesh.devices          # [data, fsdp, tensor, sequence]
    for d in range(2):                        # each data index lies within one slice
        assert len({dev.slice_index for dev in grid[d].flat}) == 1
    tpu.report(record_property, "v5p", "tiny on 2 slices of v5p-8 (data over DCN)",
               plan.train.compiled, plan.train.compile_s)
    with pytest.raises(ValueError, match=r"mesh.data: 1 is not a multiple of the 2 slices"):
        compile_plan(load_config(None, ["mesh.data=1", "mesh.fsdp=-1"], data_files=False),
                     devices, with_eval=False)


@pytest.mark.slow
def test_cli_prints_the_per_chip_plan_of_the_1_5b_config_on_v5p_128():
    run = _cli("compile", "--config", "configs/rwkv7-1.5b.yaml", "--topology", "v5p-128")
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "rwkv7-1.5b for v5p-128: 64 x TPU v5" in out and "fsdp=64" in out
    for line in ("parameters", "optimizer state", "activations + temporaries",
                 "total per chip", "train step: compiled by XLA:TPU + Mosaic",
                 "eval step: compiled by XLA:TPU + Mosaic", "roofline ESTIMATE"):
        assert line in out, line
    total = [ln for ln in out.splitlines() if "total per chip" in ln][0]
    assert "of 95.00 GiB" in total
    print(out)


@pytest.mark.slow
def test_cli_refuses_a_batch_too_large_for_the_chip_in_one_line():
    run = _cli("compile", "--config", "configs/rwkv7-1.5b.yaml", "--topology", "v5litepod-16",
               "train.batch_size=256")
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    msg = lines[0]
    assert msg.startswith("lwm-jax compile: error: train.batch_size=256, train.ctx_len=4096: ")
    assert "TPU v5 lite chip of v5litepod-16" in msg and "HBM" in msg
    assert "lower train.batch_size" in msg and "mesh.fsdp" in msg and "Traceback" not in msg


@pytest.mark.parametrize("args,match", [
    (["--topology", "v9-8"], r"--topology: unknown TPU generation 'v9'"),
    (["--num-slices", "2"], r"--num-slices: needs --topology"),
    (["--topology", "v5litepod-4", "mesh.data=3"],
     r"mesh: data\*fsdp\*tensor\*sequence = 3 but 4 devices"),
])
def test_cli_bad_input_is_one_line(args, match):
    run = _cli("compile", *args)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    import re
    assert re.search(match, run.stderr), run.stderr


@pytest.mark.slow
def test_saved_step_trains_and_every_mismatch_is_refused(tmp_path):
    """On this host's CPU device: `compile --save`, then `train --compiled` runs with it; a file
    made for another config, other devices or other versions, a damaged one and a foreign one
    are each refused in one line before anything is written."""
    # a two-layer model of width 64 on short sequences: saving, loading and refusing a compiled
    # step do not depend on its size, and the default tiny config's step takes longer to compile
    over = ["model.n_layer=2", "model.n_embd=64", "train.ctx_len=32", "train.batch_size=4",
            "train.steps=4", "train.warmup_steps=1", "train.eval_every=0", f"run_dir={tmp_path}/run"]
    saved = str(tmp_path / "step.bin")
    run = _cli("compile", "--save", saved, "--no-eval", *over)
    assert run.returncode == 0, run.stderr[-2000:]
    run = _cli("train", "--compiled", saved, "--no-progress", *over)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "loaded the compiled train step" in run.stderr + run.stdout

    cfg = load_config(None, over, data_files=False)
    header, _ = read_header(saved)
    check_header(header, saved, cfg, jax.devices())     # the same: accepted
    refused = {
        "config": (load_config(None, [*over, "train.lr=1e-3"], data_files=False),
                   jax.devices(), r"another config \(train.lr=0.001 there|train.lr"),
        "devices": (cfg, topology_devices("v5litepod-4"), r"compiled for cpu \(platform 'cpu'\)"),
    }
    for what, (c, devs, match) in refused.items():
        with pytest.raises(ValueError, match=match):
            check_header(header, saved, c, devs)
    data = open(saved, "rb").read()
    head_end = data.index(b"\n", data.index(b"\n") + 1)
    fields = json.loads(data[data.index(b"\n") + 1:head_end])
    fields["versions"]["jaxlib"] = "0.0.1"
    other = tmp_path / "other.bin"
    other.write_bytes(data[:data.index(b"\n") + 1] + json.dumps(fields).encode() + data[head_end:])
    with pytest.raises(ValueError, match=r"compiled with jaxlib 0.0.1 but jaxlib"):
        check_header(read_header(str(other))[0], str(other), cfg, jax.devices())
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(data[:-10] + b"0123456789")
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\x80\x04not a compiled step")
    for path, match in ((damaged, "is damaged"), (foreign, "is not a compiled step")):
        run = _cli("train", "--compiled", str(path), "--no-progress",
                   "train.steps=4", "train.warmup_steps=1", f"run_dir={tmp_path}/r_{path.stem}")
        assert run.returncode == 2 and match in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1
        assert not os.path.exists(tmp_path / f"r_{path.stem}" / "checkpoints")
