"""Logical-axis rules, and real training runs on 8-device CPU meshes matching one device.

The multi-device tests train one run (`RUN`) and share what they can: one single-device run
(the module's `reference`) is the baseline of both, and every driver process writes and reads
one JAX compilation cache (`compile_dir`), so a program that a later run compiles again (the
pure-sequence step compiled a second time for its HLO, the pure-sequence step of the resumed
run, the single-device step of the resumed run) is loaded, not recompiled. A program loaded
from the cache is the one compiled: what a run computes does not depend on it."""
import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from lwm_jax.data import write_binidx
from lwm_jax.train.sharding import MESH_AXES, logical_to_spec, shard_like_params


def _mesh(data=1, fsdp=1, tensor=1, sequence=1):
    return AbstractMesh((data, fsdp, tensor, sequence), MESH_AXES)


def test_logical_axis_rules():
    m = _mesh(data=2, fsdp=2, tensor=2)
    assert logical_to_spec(("vocab", "embed"), (256, 64), m) == P("tensor", "fsdp")
    spec = lambda axes, shape: logical_to_spec(axes, shape, m)  # noqa: E731
    assert spec(("layers", "embed", "mlp"), (2, 64, 256)) == P(None, "fsdp", "tensor")
    assert spec(("layers", "heads", "embed"), (2, 64, 64)) == P(None, "tensor", "fsdp")
    assert logical_to_spec(("layers", "embed", "lora"), (2, 64, 32), m) == P(None, "fsdp", None)
    assert logical_to_spec(("layers", "heads", "head_dim"), (2, 4, 64), m) == P(None, "tensor", None)
    assert logical_to_spec(("embed",), (64,), m) == P("fsdp")
    # a dim that does not divide the mesh axis stays whole
    assert logical_to_spec(("layers", "heads", "head_dim"), (2, 3, 64), m) == P(None, None, None)
    # a mesh axis is used once per array (vocab and mlp both map to tensor)
    assert logical_to_spec(("vocab", "mlp"), (256, 256), m) == P("tensor", None)
    # size-1 mesh axes shard nothing
    assert logical_to_spec(("vocab", "embed"), (256, 64), _mesh()) == P(None, None)
    with pytest.raises(ValueError, match="logical axis 'bogus' has no sharding rule"):
        logical_to_spec(("bogus",), (4,), m)


def test_optimizer_state_follows_parameter_shardings():
    params = {"a": np.zeros((2, 3)), "b": {"c": np.zeros(4)}}
    param_sh = {"a": "SH_A", "b": {"c": "SH_C"}}
    opt_state = ({"count": np.zeros(())}, (np.zeros(()), params, params))
    out = shard_like_params(opt_state, params, param_sh, mesh=_mesh())
    assert out[1][1] == param_sh and out[1][2] == param_sh
    assert out[0]["count"].spec == P() and out[1][0].spec == P()


# The run every test below trains, on one device (the `reference`), on each 8-device mesh, and
# split across two meshes (2 steps saved, 2 resumed): the same losses and parameters everywhere.
# One run for all, so that the tests share its single-device baseline and compiled programs.
# Its records are read from metrics.jsonl only: without the TensorBoard tracker a driver process
# does not import tensorboardX, which imports torch (~1 s a process).
STEPS = 4
RUN = ["model.n_layer=2", "model.n_embd=128", "train.ctx_len=32", "train.batch_size=8",
       f"train.steps={STEPS}", "train.warmup_steps=0", "train.lr=1e-3", "train.log_every=1",
       "train.eval_every=0", "checkpoint.async=false", "logging.trackers=[jsonl]",
       "train.loss_chunk=64"]  # 4 chunks of the fused loss: its layout meets the mesh

DRIVER = textwrap.dedent(r"""
    import json, re, sys
    import numpy as np
    import jax
    from lwm_jax.train.compile_cache import enable_compilation_cache
    from lwm_jax.train.config import load_config
    from flax import nnx
    from lwm_jax.layers.embedding import GATHER_SCOPE
    from lwm_jax.models.rwkv7 import RWKV7
    from lwm_jax.train.metrics import read_metrics
    from lwm_jax.train.sharding import make_mesh
    from lwm_jax.train.sharding import tokens_sharding
    from lwm_jax.train.trainer import build_program, train

    enable_compilation_cache()          # $JAX_COMPILATION_CACHE_DIR: the module's compile_dir
    out_dir, data, run, *meshes = sys.argv[1:]
    assert jax.device_count() == 1 if meshes == ["1"] else jax.device_count() > 1
    for mesh in meshes:
        sizes = dict(zip(("data", "fsdp", "tensor", "sequence"), map(int, mesh.split(","))))
        cfg = load_config(None, [*json.loads(run), f"data.path={data}",
                                 f"run_dir={out_dir}/{mesh}",
                                 *[f"mesh.{k}={v}" for k, v in sizes.items()]])
        B, T = cfg.train.batch_size, cfg.train.ctx_len
        res = train(cfg, progress=False)
        params = jax.tree_util.tree_flatten_with_path(res.state.params)[0]
        np.savez(f"{out_dir}/{mesh}.npz", **{jax.tree_util.keystr(k): np.asarray(v)
                                             for k, v in params})
        specs = {jax.tree_util.keystr(k): str(v.sharding.spec) for k, v in params}
        mu = res.state.opt_state[2].mu
        specs["mu['emb']"] = str(mu["emb"].sharding.spec)
        records = read_metrics(f"{out_dir}/{mesh}/metrics.jsonl")[0]
        # does the model on this mesh run the WKV per device (inside a shard_map)?
        full = {**dict.fromkeys(("data", "fsdp", "tensor", "sequence"), 1), **sizes}
        model = RWKV7(cfg.model, "fp32", runtime=cfg.runtime, mesh=make_mesh(full),
                      rngs=nnx.Rngs(0))
        tok = jax.numpy.zeros((B, T), jax.numpy.int32)
        seq_parallel = "shard_map" in str(jax.make_jaxpr(lambda: model(tok))())
        gathered = []      # shapes the compiled train step all-gathers; a second compile of
        # the step (loaded from the compilation cache: the program `train` just compiled), so
        # only on the pure-sequence mesh, the one whose gathers are checked below
        if sizes == {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 8}:
            prog = build_program(cfg)
            tokens = jax.ShapeDtypeStruct((B, T + 1), np.int32,
                                          sharding=tokens_sharding(prog.mesh))
            hlo = prog.train_step.lower(prog.abstract_state, tokens).compile().as_text()
            # the embedding's backward gathers its cotangents on purpose (few tokens here:
            # `lwm_jax.layers.embedding`); every other gather is listed
            gathered = [m.group(1) for m in
                        re.finditer(r"= (\S+) all-gather(?:-start)?\(.*", hlo)
                        if GATHER_SCOPE not in m.group(0)]
        json.dump({"steps": [r["step"] for r in records],
                   "losses": [r["loss"] for r in records], "val": res.final_val_loss,
                   "specs": specs, "seq_parallel": seq_parallel, "gathered": gathered},
                  open(f"{out_dir}/{mesh}.json", "w"))
""")


def _run_driver(driver, env_of, n_devices, compile_dir, *args):
    env = env_of(n_devices, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=compile_dir)
    proc = subprocess.run([sys.executable, "-c", driver, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _load(out_dir, mesh):
    with open(out_dir / f"{mesh}.json") as f:
        meta = json.load(f)
    return meta, dict(np.load(out_dir / f"{mesh}.npz"))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def compile_dir(tmp_path_factory):
    """The JAX compilation cache that every driver process of this module writes and reads
    (`$JAX_COMPILATION_CACHE_DIR`): a program compiled again, in the same process or a later
    one with as many devices, is loaded from it."""
    return str(tmp_path_factory.mktemp("sharding-jax-compile"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Ten patterned documents of 600 tokens (binidx prefix)."""
    prefix = str(tmp_path_factory.mktemp("sharding-data") / "pattern")
    write_binidx(prefix, [(np.arange(600) * (d + 1)) % 61 + 1 for d in range(10)], np.uint16,
                 append_eod=True)
    return prefix


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data, compile_dir, subprocess_env):
    """`RUN` trained on one device, from a fresh start: (metadata, parameters)."""
    out_dir = tmp_path_factory.mktemp("sharding-reference")
    _run_driver(DRIVER, subprocess_env, 1, compile_dir, out_dir, data, json.dumps(RUN), "1")
    return _load(out_dir, "1")


@pytest.mark.slow
def test_8_device_meshes_match_one_device(tmp_path, data, compile_dir, reference,
                                          subprocess_env):
    """Pure data, fsdp x tensor (parameters and moments sharded), data x tensor x sequence,
    fsdp x sequence and pure sequence meshes over 8 devices: the same losses, validation loss
    and parameters as one device (batch 8); with a `sequence` axis every layer's WKV runs
    sequence-parallel (4-token slices at sequence 8)."""
    meshes = ["8,1,1,1", "1,4,2,1", "2,1,2,2", "1,2,1,4", "1,1,1,8"]
    _run_driver(DRIVER, subprocess_env, 8, compile_dir, tmp_path, data, json.dumps(RUN),
                *meshes)
    ref, ref_params = reference
    assert ref["steps"] == list(range(1, STEPS + 1))
    assert ref["losses"][2] < ref["losses"][0]                              # it learns
    for mesh in meshes:
        meta, params = _load(tmp_path, mesh)
        assert params.keys() == ref_params.keys(), mesh
        # the WKV runs per device inside a shard_map on every multi-device mesh, with T split
        # over `sequence` inside it (not only around it) wherever that axis splits
        assert meta["seq_parallel"], mesh
        if mesh == "1,1,1,8":
            # parameters are replicated here, so nothing of width n_embd (128) is gathered: the
            # loss runs on each device's own tokens (its chunks are strided over T), not on
            # hidden states all-gathered from every device
            assert not [g for g in meta["gathered"] if re.search(r"\b128\]", g)], meta["gathered"]
            assert meta["gathered"], "the WKV's per-slice transitions are all-gathered"
        assert meta["steps"] == ref["steps"], mesh
        np.testing.assert_allclose(meta["losses"], ref["losses"], rtol=2e-5, err_msg=mesh)
        assert abs(meta["val"] - ref["val"]) <= 2e-5 * ref["val"], mesh
        for k in params:
            assert _rel(params[k], ref_params[k]) < 1e-4, (mesh, k, _rel(params[k], ref_params[k]))
    specs = _load(tmp_path, "1,4,2,1")[0]["specs"]
    assert specs["['emb']"] == str(P("tensor", "fsdp"))
    assert specs["['blocks']['ffn']['key']"] == str(P(None, "fsdp", "tensor"))
    assert specs["['blocks']['att']['output']"] == str(P(None, "tensor", "fsdp"))
    assert specs["mu['emb']"] == str(P("tensor", "fsdp"))
    assert specs["['blocks']['att']['w1']"] == str(P(None, "fsdp", None))


RESHARD_DRIVER = textwrap.dedent("""
    import json, shutil, sys
    import jax
    from lwm_jax.train.compile_cache import enable_compilation_cache
    from lwm_jax.train.config import load_config
    from lwm_jax.train.metrics import read_metrics
    from lwm_jax.train.trainer import train

    enable_compilation_cache()          # $JAX_COMPILATION_CACHE_DIR: the module's compile_dir
    out_dir, data, run, phase = sys.argv[1:]

    def train_on(name, mesh, stop_after=None):
        sizes = dict(zip(("data", "fsdp", "tensor", "sequence"), map(int, mesh.split(","))))
        cfg = load_config(None, [*json.loads(run), f"data.path={data}",
                                 f"run_dir={out_dir}/{name}",
                                 *[f"mesh.{k}={v}" for k, v in sizes.items()]])
        train(cfg, progress=False, stop_after=stop_after)
        return {r["step"]: r["loss"] for r in read_metrics(f"{out_dir}/{name}/metrics.jsonl")[0]}

    if phase == "save":             # 8 devices: 2 steps on (2,4,1,1), then resume on (1,1,1,8)
        assert jax.device_count() == 8
        train_on("saved", "2,4,1,1", stop_after=2)
        shutil.copytree(f"{out_dir}/saved", f"{out_dir}/one")
        losses = train_on("saved", "1,1,1,8")
    else:                           # 1 device: the (2,4,1,1) checkpoint resumed
        assert jax.device_count() == 1
        losses = train_on("one", "1,1,1,1")
    json.dump(losses, open(f"{out_dir}/{phase}.json", "w"))
""")


@pytest.mark.slow
def test_a_checkpoint_saved_on_one_mesh_resumes_on_another_and_on_one_device(tmp_path, data,
                                                                             compile_dir,
                                                                             reference,
                                                                             subprocess_env):
    """Saved sharded on (data 2, fsdp 4), restored onto (sequence 8) and onto one device: both
    continue with the losses of an uninterrupted single-device run (the `reference`)."""
    for phase, n in (("save", 8), ("resume", 1)):
        _run_driver(RESHARD_DRIVER, subprocess_env, n, compile_dir, tmp_path, data,
                    json.dumps(RUN), phase)
    on_8 = {int(k): v for k, v in json.load(open(tmp_path / "save.json")).items()}
    on_1 = {int(k): v for k, v in json.load(open(tmp_path / "resume.json")).items()}
    plain = dict(zip(reference[0]["steps"], reference[0]["losses"]))
    assert sorted(plain) == [1, 2, 3, 4] and plain[4] < plain[1]
    for run in (on_8, on_1):        # steps 1-2 from the (2,4,1,1) run, 3-4 after the restore
        assert sorted(run) == [1, 2, 3, 4], run
        np.testing.assert_allclose([run[s] for s in (1, 2, 3, 4)],
                                   [plain[s] for s in (1, 2, 3, 4)], rtol=2e-5)
