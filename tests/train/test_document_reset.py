"""`data.reset_at_document_boundary`: a packed window of documents trains like the documents
run one by one (per-token logits, loss, gradients) on every path the trainer compiles (train step
with gradient accumulation, eval step, fused and unfused loss, RWKV-7 and Llama, a sharded
data x sequence mesh), and with resets off the window differs (RWKV-LM's default)."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax.train.batches import eod_id_for
from lwm_jax.train.config import DataSection, load_config
from lwm_jax.train.optimizer import AdamF32State
from lwm_jax.train.step import document_segment_ids, model_loss
from lwm_jax.train.trainer import build_program

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 32
RWKV = ["model.n_layer=1", "model.n_embd=64", "model.head_size=32"]
LLAMA = ["arch=llama", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
         "model.n_kv_head=1", "model.head_dim=32", "model.ffn_hidden=128",
         "model.max_seq_len=64"]
COMMON = [f"train.ctx_len={T}", "train.batch_size=2", "train.grad_accum=2",
          "train.loss_chunk=16", "train.warmup_steps=0", "train.steps=4", "train.grad_clip=0",
          "mesh.data=1"]


def packed_rows(rng, splits):
    """Windows `[len(splits), T+1]` of two documents each, `0 A 0 B 0` (EOD = 0 ends every
    document, so it also precedes the next one), and the per-document streams `0 X 0`."""
    rows, docs = [], []
    for n_a in splits:
        a = rng.integers(1, 256, n_a)
        b = rng.integers(1, 256, T - 2 - n_a)
        rows.append(np.concatenate([[0], a, [0], b, [0]]))
        docs.append([np.concatenate([[0], a, [0]]), np.concatenate([[0], b, [0]])])
    return np.stack(rows).astype(np.int32), docs


def test_segment_ids_rise_at_every_end_of_document_token():
    ids = document_segment_ids(jnp.array([[5, 0, 7, 8, 0, 9], [0, 3, 3, 0, 0, 1]]), 0)
    np.testing.assert_array_equal(ids, [[0, 1, 1, 1, 2, 2], [1, 1, 1, 2, 3, 3]])
    assert ids.dtype == jnp.int32
    assert eod_id_for(DataSection()) == 0 and eod_id_for(DataSection(tokenizer="world")) == 0


def perturbed(state, seed=0, scale=0.05):
    """`state` with noise on every parameter: RWKV-7's initial model ignores the context
    (zero output projections), and the test needs one whose tokens see each other."""
    rng = np.random.default_rng(seed)
    noisy = jax.tree.map(lambda x: x + (scale * rng.standard_normal(x.shape)).astype(x.dtype),
                         state.params)
    return dataclasses.replace(state, params=noisy)


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def first_gradient(opt_state, beta1):
    """The gradient of the first optimizer step, read back from Adam's first moment
    (`mu = (1 - beta1) g` after one step from zero; no clipping: `train.grad_clip=0`)."""
    (adam,) = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AdamF32State))
               if isinstance(x, AdamF32State)]
    return jax.tree.map(lambda m: m / (1 - beta1), adam.mu)


@pytest.mark.parametrize("family", [pytest.param("rwkv7", marks=pytest.mark.slow), "llama"])
def test_packed_documents_train_like_separate_documents(family):
    base = (RWKV if family == "rwkv7" else LLAMA) + COMMON
    on = build_program(load_config(None, base + ["data.reset_at_document_boundary=true"]))
    off = build_program(load_config(None, base))
    half = (T - 2) // 2          # equal documents: the four separate runs form one batch
    tokens, docs = packed_rows(np.random.default_rng(1), [half, half])
    separate = np.stack([d for pair in docs for d in pair])               # [4, T/2 + 1]
    state = perturbed(on.init_state())
    params = state.params

    # per token: the logits of the packed window equal each document's own logits
    forward = jax.jit(lambda p, x, seg: nnx.merge(on.graphdef, p)(x, segment_ids=seg))
    inputs = jnp.asarray(tokens[:, :-1])
    packed = forward(params, inputs, document_segment_ids(inputs, 0))
    alone = forward(params, jnp.asarray(separate[:, :-1]), None)
    np.testing.assert_allclose(packed.reshape(alone.shape), alone, rtol=2e-5, atol=2e-5)

    # the separate runs' loss and gradient (L2Wrap included; unfused: the same math as the
    # step's fused loss, and quicker to compile)
    def loss_of(p, toks):
        return model_loss(nnx.merge(on.graphdef, p), toks[:, :-1], toks[:, 1:],
                          use_l2wrap=True, loss_chunk=0)
    want, want_grads = jax.jit(jax.value_and_grad(loss_of))(params, jnp.asarray(separate))
    want = float(want)

    # eval step: equal with resets; without them the documents see each other
    whole = jax.sharding.NamedSharding(on.mesh, jax.sharding.PartitionSpec())
    batch = jax.device_put(tokens, whole)
    assert float(on.eval_step(params, None, batch)) == pytest.approx(want, rel=1e-5)
    assert abs(float(off.eval_step(params, None, batch)) - want) > 1e-4 * want     # 10x the tolerance

    # train step, two micro-batches of one row: same loss, same gradient
    new_state, metrics = on.train_step(state, jax.device_put(tokens.reshape(2, 1, T + 1), whole))
    assert float(metrics["loss"]) == pytest.approx(want, rel=1e-5)
    grads = first_gradient(new_state.opt_state, on.cfg.train.betas[0])
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(want_grads)):
        if float(jnp.linalg.norm(w)) > 0:
            assert _rel(g, w) < 1e-5, (path, _rel(g, w))


DRIVER = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    sys.path.insert(0, sys.argv[1])
    from test_document_reset import RWKV, T, packed_rows, perturbed
    from lwm_jax.models.rwkv7 import RWKV7
    from lwm_jax.train.config import load_config
    from lwm_jax.train.loss import cross_entropy
    from lwm_jax.train.params import split_model
    from lwm_jax.train.sharding import tokens_sharding
    from lwm_jax.train.step import document_segment_ids
    from lwm_jax.train.trainer import build_program

    cfg = load_config(None, RWKV + [f"train.ctx_len={T}", "train.batch_size=4",
                                    "train.warmup_steps=0", "train.steps=4", "mesh.data=2",
                                    "mesh.sequence=2", "data.reset_at_document_boundary=true"])
    prog = build_program(cfg)
    state = perturbed(prog.init_state())
    tokens, _ = packed_rows(np.random.default_rng(2), [5, 11, 17, 24])
    # the reference: the same parameters in a model without a mesh, on one device
    graphdef = split_model(nnx.eval_shape(lambda: RWKV7(cfg.model, prog.policy,
                                                        runtime=cfg.runtime,
                                                        rngs=nnx.Rngs(0))))[0]
    one = nnx.merge(graphdef, jax.device_get(state.params))
    x = jnp.asarray(tokens[:, :-1])
    want = float(cross_entropy(one(x, segment_ids=document_segment_ids(x, 0)),
                               jnp.asarray(tokens[:, 1:])))
    plain = float(cross_entropy(one(x), jnp.asarray(tokens[:, 1:])))
    batch = jax.device_put(tokens, tokens_sharding(prog.mesh))
    got_eval = float(prog.eval_step(state.params, state.fp8, batch))
    print(json.dumps({"want": want, "plain": plain, "eval": got_eval,
                      "devices": jax.device_count(), "seq_parallel": prog.mesh.shape["sequence"]}))
""")


def test_sharded_batch_resets_documents_like_one_device(subprocess_env):
    """data=2 x sequence=2 on 4 CPU devices: the segment ids are split like the tokens (the
    WKV runs sequence-parallel, documents starting inside either half of the window)."""
    env = subprocess_env(4, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DRIVER, os.path.dirname(__file__)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["seq_parallel"] == 2
    assert abs(out["plain"] - out["want"]) > 1e-4 * out["want"]      # 10x the tolerance below
    assert out["eval"] == pytest.approx(out["want"], rel=1e-5)
