"""The package's import graph: no cycle between `lwm_jax` packages, no arrow the layering
forbids (the models never import the diagnostics built on them; the ops import neither layers
nor models), and the WKV7 kernels (`pallas_gpu`, `mosaic_gpu`, `pallas_tpu`) import only the
op's leaf modules (`LEAVES`: its contract, the shared triangular inverse, the shared tile
products `tile_dots`, the packed-document `segments`, the checkpoint names), never the op.

Read from the source with `ast` (module-level and function-level imports alike: a lazy import
is still a dependency), so a new cycle fails here before it fails at import time."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lwm_jax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every `lwm_jax...` module named by an import in `path` (for `from X import y`, `X.y`
    when that is a module, else `X`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lwm_jax"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("lwm_jax"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
    return out


FILES = sorted(ROOT.rglob("*.py"))
MODULES = {_module_name(p) for p in FILES}
GRAPH = {_module_name(p): _imports(p) for p in FILES}


def _unit(module: str) -> str:
    """The package a module belongs to for the cycle check: `lwm_jax.<first part>`."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None
    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_was_read():
    assert "lwm_jax.ops.wkv7.dispatch" in GRAPH and "lwm_jax.models.rwkv7.model" in GRAPH
    assert "lwm_jax.ops.wkv7.contract" in GRAPH["lwm_jax.ops.wkv7.dispatch"]


def test_no_cycle_between_lwm_jax_packages():
    edges: dict[str, set[str]] = {}
    for mod, deps in GRAPH.items():
        for dep in deps:
            a, b = _unit(mod), _unit(dep)
            if a != b and a != "lwm_jax" and b != "lwm_jax":
                edges.setdefault(a, set()).add(b)
    cycle = _find_cycle(edges)
    where = ""
    if cycle:
        pairs = list(zip(cycle, cycle[1:]))
        where = "; ".join(f"{a} -> {b} via " + ", ".join(
            sorted(m for m, d in GRAPH.items() if _unit(m) == a and any(_unit(x) == b for x in d)))
            for a, b in pairs)
    assert cycle is None, f"import cycle {' -> '.join(cycle)} ({where})"


def test_the_cycle_check_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


LEAVES = {"lwm_jax.ops.wkv7.contract", "lwm_jax.ops.wkv7.tril_inverse",
          "lwm_jax.ops.wkv7.tile_dots", "lwm_jax.ops.segments", "lwm_jax.remat_names"}
# leaves the kernels do not import: the probe hook the models call
OTHER_LEAVES = {"lwm_jax.probe"}

# (importer, imported) package prefixes no module may connect
FORBIDDEN = [("lwm_jax.models", "lwm_jax.diagnostics"), ("lwm_jax.layers", "lwm_jax.diagnostics"),
             ("lwm_jax.ops", "lwm_jax.diagnostics"), ("lwm_jax.ops", "lwm_jax.layers"),
             ("lwm_jax.ops", "lwm_jax.models"), ("lwm_jax.layers", "lwm_jax.models")]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_forbidden_arrows(importer, imported):
    bad = {m: sorted(d for d in deps if _within(d, imported))
           for m, deps in GRAPH.items() if _within(m, importer)}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"{importer} must not import {imported}: {bad}"


def test_the_forbidden_arrow_check_sees_an_arrow():
    """The check reads the graph's arrows: trainer -> models exists and is seen."""
    assert any(_within(d, "lwm_jax.models") for d in GRAPH["lwm_jax.train.trainer"])
    assert not _within("lwm_jax.modelsx", "lwm_jax.models")


@pytest.mark.parametrize("kernel_pkg", ["lwm_jax.ops.wkv7.pallas_gpu",
                                        "lwm_jax.ops.wkv7.mosaic_gpu",
                                        "lwm_jax.ops.wkv7.pallas_tpu"])
def test_kernels_import_only_the_leaf_contract(kernel_pkg):
    bad = {m: sorted(d - LEAVES) for m, d in GRAPH.items() if m.startswith(kernel_pkg)
           for d in [{x for x in d if not x.startswith(kernel_pkg)}] if d - LEAVES}
    assert not bad, f"kernel modules import beyond the op's leaves: {bad}"


def test_the_leaves_are_leaves():
    for leaf in LEAVES | OTHER_LEAVES:
        assert GRAPH[leaf] == set(), leaf
