"""Logical-axis rules, and a real train step on a 4-device CPU mesh matching one device."""
import json
import os
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


DRIVER = textwrap.dedent(r"""
    import json, re, sys
    import numpy as np
    import jax
    from lwm_jax.train.config import load_config
    from flax import nnx
    from lwm_jax.layers.embedding import GATHER_SCOPE
    from lwm_jax.models.rwkv7 import RWKV7
    from lwm_jax.train.metrics import read_metrics
    from lwm_jax.train.sharding import make_mesh
    from lwm_jax.train.sharding import tokens_sharding
    from lwm_jax.train.trainer import build_program, train

    out_dir, data, batch, *meshes = sys.argv[1:]
    assert jax.device_count() == 1 if meshes == ["1"] else jax.device_count() > 1
    for mesh in meshes:
        sizes = dict(zip(("data", "fsdp", "tensor", "sequence"), map(int, mesh.split(","))))
        cfg = load_config(None, [
            "model.n_layer=2", "model.n_embd=128", "train.ctx_len=32", f"train.batch_size={batch}",
            "train.steps=3", "train.warmup_steps=0", "train.lr=1e-3", "train.log_every=1",
            "train.eval_every=0", "checkpoint.async=false", f"data.path={data}",
            "train.loss_chunk=64",  # 4 chunks of the fused loss: its layout meets the mesh
            f"run_dir={out_dir}/{mesh}", *[f"mesh.{k}={v}" for k, v in sizes.items()]])
        res = train(cfg, progress=False)
        params = jax.tree_util.tree_flatten_with_path(res.state.params)[0]
        np.savez(f"{out_dir}/{mesh}.npz", **{jax.tree_util.keystr(k): np.asarray(v)
                                             for k, v in params})
        specs = {jax.tree_util.keystr(k): str(v.sharding.spec) for k, v in params}
        mu = res.state.opt_state[2].mu
        specs["mu['emb']"] = str(mu["emb"].sharding.spec)
        losses = [r["loss"] for r in read_metrics(f"{out_dir}/{mesh}/metrics.jsonl")[0]]
        # does the model on this mesh run the WKV per device (inside a shard_map)?
        full = {**dict.fromkeys(("data", "fsdp", "tensor", "sequence"), 1), **sizes}
        model = RWKV7(cfg.model, "fp32", runtime=cfg.runtime, mesh=make_mesh(full),
                      rngs=nnx.Rngs(0))
        tok = jax.numpy.zeros((int(batch), 32), jax.numpy.int32)
        seq_parallel = "shard_map" in str(jax.make_jaxpr(lambda: model(tok))())
        gathered = []      # shapes the compiled train step all-gathers; a second compile of
        # the step, so only on the pure-sequence mesh, the one whose gathers are checked below
        if sizes == {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 8}:
            prog = build_program(cfg)
            tokens = jax.ShapeDtypeStruct((int(batch), 33), np.int32,
                                          sharding=tokens_sharding(prog.mesh))
            hlo = prog.train_step.lower(prog.abstract_state, tokens).compile().as_text()
            # the embedding's backward gathers its cotangents on purpose (few tokens here:
            # `lwm_jax.layers.embedding`); every other gather is listed
            gathered = [m.group(1) for m in
                        re.finditer(r"= (\S+) all-gather(?:-start)?\(.*", hlo)
                        if GATHER_SCOPE not in m.group(0)]
        json.dump({"losses": losses, "val": res.final_val_loss, "specs": specs,
                   "seq_parallel": seq_parallel, "gathered": gathered},
                  open(f"{out_dir}/{mesh}.json", "w"))
""")


def _run_driver(tmp_path, data, meshes, n_devices, batch=4):
    flags = f"--xla_force_host_platform_device_count={n_devices}" if n_devices > 1 else ""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), data, str(batch),
                           *meshes], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _load(tmp_path, mesh):
    with open(tmp_path / f"{mesh}.json") as f:
        meta = json.load(f)
    return meta, dict(np.load(tmp_path / f"{mesh}.npz"))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
def test_8_device_meshes_match_one_device(tmp_path):
    """Pure data, fsdp x tensor (parameters and moments sharded), data x tensor x sequence,
    fsdp x sequence and pure sequence meshes over 8 devices: the same losses, validation loss
    and parameters as one device (batch 8); with a `sequence` axis every layer's WKV runs
    sequence-parallel (4-token slices at sequence 8)."""
    data = str(tmp_path / "pattern")
    write_binidx(data, [(np.arange(600) * (d + 1)) % 61 + 1 for d in range(10)], np.uint16,
                 append_eod=True)
    meshes = ["8,1,1,1", "1,4,2,1", "2,1,2,2", "1,2,1,4", "1,1,1,8"]
    _run_driver(tmp_path, data, ["1"], 1, batch=8)
    _run_driver(tmp_path, data, meshes, 8, batch=8)
    ref, ref_params = _load(tmp_path, "1")
    assert len(ref["losses"]) == 3 and ref["losses"][2] < ref["losses"][0]   # it learns
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
    from lwm_jax.train.config import load_config
    from lwm_jax.train.metrics import read_metrics
    from lwm_jax.train.trainer import train

    out_dir, data, phase = sys.argv[1:]

    def run(name, mesh, stop_after=None):
        sizes = dict(zip(("data", "fsdp", "tensor", "sequence"), map(int, mesh.split(","))))
        cfg = load_config(None, [
            "model.n_layer=2", "model.n_embd=128", "train.ctx_len=32", "train.batch_size=8",
            "train.steps=4", "train.warmup_steps=0", "train.lr=1e-3", "train.log_every=1",
            "train.eval_every=0", "checkpoint.async=false", f"data.path={data}",
            f"run_dir={out_dir}/{name}", *[f"mesh.{k}={v}" for k, v in sizes.items()]])
        train(cfg, progress=False, stop_after=stop_after)
        return {r["step"]: r["loss"] for r in read_metrics(f"{out_dir}/{name}/metrics.jsonl")[0]}

    if phase == "save":             # 8 devices: 2 steps on (2,4,1,1), then resume on (1,1,1,8)
        assert jax.device_count() == 8
        run("saved", "2,4,1,1", stop_after=2)
        shutil.copytree(f"{out_dir}/saved", f"{out_dir}/one")
        losses = run("saved", "1,1,1,8")
    else:                           # 1 device: the (2,4,1,1) checkpoint resumed; a plain run
        assert jax.device_count() == 1
        losses = {"resumed": run("one", "1,1,1,1"), "plain": run("plain", "1,1,1,1")}
    json.dump(losses, open(f"{out_dir}/{phase}.json", "w"))
""")


@pytest.mark.slow
def test_a_checkpoint_saved_on_one_mesh_resumes_on_another_and_on_one_device(tmp_path):
    """Saved sharded on (data 2, fsdp 4), restored onto (sequence 8) and onto one device: both
    continue with the losses of an uninterrupted single-device run."""
    data = str(tmp_path / "pattern")
    write_binidx(data, [(np.arange(600) * (d + 1)) % 61 + 1 for d in range(10)], np.uint16,
                 append_eod=True)
    for phase, n in (("save", 8), ("resume", 1)):
        flags = f"--xla_force_host_platform_device_count={n}" if n > 1 else ""
        proc = subprocess.run([sys.executable, "-c", RESHARD_DRIVER, str(tmp_path), data, phase],
                              env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    on_8 = {int(k): v for k, v in json.load(open(tmp_path / "save.json")).items()}
    later = json.load(open(tmp_path / "resume.json"))
    plain = {int(k): v for k, v in later["plain"].items()}
    on_1 = {int(k): v for k, v in later["resumed"].items()}
    assert sorted(plain) == [1, 2, 3, 4] and plain[4] < plain[1]
    for run in (on_8, on_1):        # steps 1-2 from the (2,4,1,1) run, 3-4 after the restore
        assert sorted(run) == [1, 2, 3, 4], run
        np.testing.assert_allclose([run[s] for s in (1, 2, 3, 4)],
                                   [plain[s] for s in (1, 2, 3, 4)], rtol=2e-5)
