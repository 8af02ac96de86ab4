"""`models.stacked.unstack`: per-layer views whose gradient is one stack, not L padded sums."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.stacked import unstack

L = 4


def _tree():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.standard_normal((L, 3, 5)), jnp.float32),
            "n": {"b": jnp.asarray(rng.standard_normal((L, 5)), jnp.float32)}}


def _loss(views):
    # layer 2 is not used: its gradient is zero
    return sum(jnp.sum(jnp.sin(v["w"]) * v["n"]["b"] * (l + 1))
               for l, v in enumerate(views) if l != 2)


def _indexed(tree):
    return [jax.tree.map(lambda a: a[l], tree) for l in range(L)]


def test_views_and_gradient_equal_indexing():
    tree = _tree()
    for a, b in zip(jax.tree.leaves(unstack(tree, L)), jax.tree.leaves(_indexed(tree))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = jax.grad(lambda t: _loss(unstack(t, L)))(tree)
    want = jax.grad(lambda t: _loss(_indexed(t)))(tree)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.any(np.asarray(got["w"][2]))


def _primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                yield from _primitives(getattr(inner, "jaxpr", inner))


def test_the_gradient_is_stacked_not_padded_and_summed():
    tree = _tree()
    ours = list(_primitives(jax.make_jaxpr(jax.grad(lambda t: _loss(unstack(t, L))))(tree).jaxpr))
    indexed = list(_primitives(jax.make_jaxpr(jax.grad(lambda t: _loss(_indexed(t))))(tree).jaxpr))
    assert "pad" in indexed or "add_any" in indexed or "dynamic_update_slice" in indexed
    assert not {"pad", "add_any", "dynamic_update_slice"} & set(ours)
    assert ours.count("stack") + ours.count("concatenate") == len(jax.tree.leaves(tree))


def test_a_leaf_without_the_layer_axis_is_refused():
    with pytest.raises(ValueError, match="leading layer axis of 4"):
        unstack({"w": jnp.zeros((3, 5))}, L)
