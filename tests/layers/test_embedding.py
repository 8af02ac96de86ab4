"""The embedding lookup: when its gradient is reduced by gathering tokens, and that the gathered
gradient equals the plain one while the compiled step all-reduces no `[V, C]` table."""
import json
import subprocess
import sys
import textwrap

from jax.sharding import AbstractMesh

from lwm_jax.layers.embedding import gathers_gradient
from lwm_jax.train.sharding import MESH_AXES


def _mesh(data=1, fsdp=1, tensor=1, sequence=1):
    return AbstractMesh((data, fsdp, tensor, sequence), MESH_AXES)


def test_gathering_is_chosen_only_where_it_moves_fewer_bytes():
    V = 65536
    assert not gathers_gradient(None, (2, 512), V)
    assert not gathers_gradient(_mesh(), (2, 512), V)                  # one device
    assert gathers_gradient(_mesh(data=2), (4, 4096), V)               # 1.5B, 2 x (2 x 4096)
    assert gathers_gradient(_mesh(data=2), (16, 4096), V)              # 0.1B, 2 x (8 x 4096)
    assert not gathers_gradient(_mesh(data=8), (64, 4096), V)          # 2V tokens or more
    assert not gathers_gradient(_mesh(sequence=2), (1, 1 << 20), V)    # a million tokens
    assert gathers_gradient(_mesh(data=2, sequence=2), (2, 4096), V)
    # a sharded table's gradient is reduce-scattered already: left to XLA
    assert not gathers_gradient(_mesh(fsdp=2), (2, 512), V)
    assert not gathers_gradient(_mesh(data=2, tensor=2), (2, 512), V)
    # tokens that do not split evenly over the activations' layout (e.g. a 1-row generate)
    assert not gathers_gradient(_mesh(data=2), (1, 512), V)
    assert not gathers_gradient(_mesh(sequence=2), (2, 511), V)


DRIVER = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from lwm_jax.layers.embedding import GATHER_SCOPE, embedding_lookup
    from lwm_jax.train.sharding import make_mesh

    V, C, B, T = 96, 16, 4, 24
    k = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(k[0], (V, C), jnp.float32)
    tokens = jax.random.randint(k[1], (B, T), 0, V)
    tokens = tokens.at[0, :6].set(7)                 # repeated ids add up
    tokens = tokens.at[1, 0].set(V + 3)              # out of range: no row, no gradient
    w = jax.random.normal(k[2], (B, T, C), jnp.float32)

    def loss(t, tok, mesh):
        return jnp.sum(jnp.nan_to_num(embedding_lookup(t, tok, mesh)) * w)

    ref = np.asarray(jax.grad(loss)(table, tokens, None), np.float64)
    out = {}
    for name, sizes in {"data4": (4, 1, 1, 1), "data2_seq2": (2, 1, 1, 2)}.items():
        mesh = make_mesh(dict(zip(("data", "fsdp", "tensor", "sequence"), sizes)))
        tok = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"), "sequence")))
        tab = jax.device_put(table, NamedSharding(mesh, P()))
        for label, m in ((name, mesh), (name + "_plain", None)):
            f = jax.jit(jax.grad(loss), static_argnums=2)
            g = np.asarray(f(tab, tok, m), np.float64)
            hlo = f.lower(tab, tok, m).compile().as_text()
            out[label] = {"rel": float(np.linalg.norm(g - ref) / np.linalg.norm(ref)),
                          "all_reduce": hlo.count(" all-reduce(") + hlo.count("all-reduce-start("),
                          "all_gather": hlo.count(" all-gather(") + hlo.count("all-gather-start("),
                          "named": all(GATHER_SCOPE in ln for ln in hlo.splitlines()
                                       if " all-gather(" in ln or "all-gather-start(" in ln)}
    print("RESULT " + json.dumps(out))
""")


def test_gathered_gradient_equals_the_plain_one_and_reduces_no_table(subprocess_env):
    env = subprocess_env(4, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    for name in ("data4", "data2_seq2"):
        assert out[name]["rel"] < 1e-6, out
        assert out[name]["all_reduce"] == 0 and out[name]["all_gather"] > 0, out
        assert out[name]["named"], out     # what test_sharding tells apart from other gathers
        # without the mesh, XLA reduces the per-device partial tables: the count can fail
        assert out[name + "_plain"]["rel"] < 1e-6, out
        assert out[name + "_plain"]["all_reduce"] > 0, out
