#!/usr/bin/env python
"""Re-plant known bugs, one at a time, in a temporary copy of the package and check that the
tests written to catch them fail there (mutation testing on demand; not run in CI).

    python tools/plant_bugs.py                 # every plant (several minutes on 2 CPU cores)
    python tools/plant_bugs.py --list          # names, files and the tests that must kill them
    python tools/plant_bugs.py decay-bf16-at-wkv7-call hf-r-k-swapped
    python tools/plant_bugs.py --no-baseline   # skip the check that the tests pass unplanted

For each plant: copy `lwm_jax/`, `tests/`, `configs/` and `pyproject.toml` into a fresh
temporary directory, replace one snippet of one library file there (the snippet must occur
exactly once; a plant whose snippet is gone is reported STALE, not silently skipped), and run
the plant's tests with pytest from that directory (so `import lwm_jax` is the planted copy;
checked before the tests run). KILLED = at least one of its tests failed, SURVIVED = all
passed, ERROR = pytest could not run them (collection error, ...). The real checkout is only
read: no file in it is written (no .pytest_cache, no bytecode). Exit status 1 when any plant
survived, was stale or errored, or when the unplanted baseline fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("lwm_jax", "tests", "configs", "pyproject.toml")


@dataclasses.dataclass(frozen=True)
class Plant:
    name: str
    file: str                                # library file, relative to the repository root
    edits: tuple[tuple[str, str], ...]       # alternatives (old, new); the first found is used
    tests: tuple[str, ...]                   # pytest node ids that must fail
    what: str


S = "tests/test_survivors.py::"
PLANTS = [
    # ---- the survivors of the Hardening issue -------------------------------------------------
    Plant("decay-bf16-at-wkv7-call", "lwm_jax/models/rwkv7/time_mix.py",
          (("o, wkv_BHNN = wkv7(r4, heads(w), k4,",
            "o, wkv_BHNN = wkv7(r4, heads(w).astype(jnp.bfloat16).astype(f32), k4,"),),
          (S + "test_decay_handed_to_wkv7_is_the_fp32_decay",),
          "the decay rounded through bf16 where TimeMix calls wkv7 (dtype still f32)"),
    Plant("kk-product-in-compute-dtype", "lwm_jax/models/rwkv7/time_mix.py",
          (('kk = normalize_heads((k.astype(f32) * p["k_k"].astype(f32)).reshape(B, T, H, N))',
            'kk = normalize_heads((k * p["k_k"].astype(cd)).reshape(B, T, H, N))'),),
          (S + "test_kk_handed_to_wkv7_is_fp32_normalised_then_rounded",),
          "k * k_k computed in the compute dtype before the (fp32) normalisation"),
    Plant("einsum-without-precision", "lwm_jax/precision/policy.py",
          (("y = jnp.einsum(spec, *ops, precision=self.lax_precision,",
            "y = jnp.einsum(spec, *ops,"),),
          (S + "test_every_matmul_has_an_explicit_precision",),
          "precision= dropped from Policy.einsum"),
    Plant("einsum-f32-without-precision", "lwm_jax/precision/policy.py",
          (("return jnp.einsum(spec, *ops, precision=self.lax_precision,",
            "return jnp.einsum(spec, *ops,"),),
          (S + "test_every_matmul_has_an_explicit_precision",),
          "precision= dropped from Policy.einsum_f32"),
    Plant("fp16-grads-not-unscaled", "lwm_jax/train/step.py",
          (("        grads = state.loss_scale.unscale(grads)\n", ""),),
          ("tests/test_precision.py::test_fp16_step_unscales_its_gradients",),
          "the fp16 step feeds loss-scaled gradients to clipping/Adam"),
    Plant("trainer-l2wrap-always-on", "lwm_jax/train/trainer.py",
          (("use_l2wrap=t.l2wrap", "use_l2wrap=True"),),
          (S + "test_trainer_passes_train_l2wrap_to_the_step",),
          "the trainer ignores train.l2wrap (always on)"),
    Plant("trainer-l2wrap-always-off", "lwm_jax/train/trainer.py",
          (("use_l2wrap=t.l2wrap", "use_l2wrap=False"),),
          (S + "test_trainer_passes_train_l2wrap_to_the_step",),
          "the trainer ignores train.l2wrap (always off)"),
    Plant("step-l2wrap-always-on", "lwm_jax/train/step.py",
          (("use_l2wrap=use_l2wrap, loss_chunk=loss_chunk)",
            "use_l2wrap=True, loss_chunk=loss_chunk)"),
           ("lm_loss(logits_BTV, targets_BT, use_l2wrap=use_l2wrap)",
            "lm_loss(logits_BTV, targets_BT, use_l2wrap=True)")),
          (S + "test_trainer_passes_train_l2wrap_to_the_step",),
          "the train step ignores its use_l2wrap argument"),
    Plant("hf-r-k-swapped", "lwm_jax/interop/layout.py",
          (('(("receptance", "r_proj"), ("key", "k_proj"),',
            '(("receptance", "k_proj"), ("key", "r_proj"),'),),
          (S + "test_hf_export_matches_fla_layout_literally",),
          "HF export (and import) swaps r_proj and k_proj"),
    # ---- the fp32 islands and the other rewritten tests -------------------------------------
    Plant("decay-island-in-compute-dtype", "lwm_jax/models/rwkv7/time_mix.py",
          (('    hidden = jnp.tanh(policy.einsum_f32("btc,cr->btr", x_w_BTC, p["w1"]))\n'
            '    d = p["w0"].astype(jnp.float32) + policy.einsum_f32("btr,rc->btc", hidden, '
            'p["w2"])\n',
            '    hidden = jnp.tanh(policy.einsum("btc,cr->btr", x_w_BTC, p["w1"]))\n'
            '    d = p["w0"].astype(policy.compute_dtype) + policy.einsum("btr,rc->btc", hidden, '
            'p["w2"])\n'),),
          ("tests/test_fp32_islands.py::test_a_decay_is_computed_in_fp32",
           S + "test_decay_handed_to_wkv7_is_the_fp32_decay"),
          "decay_log computed in the compute dtype (no decay island)"),
    Plant("layer-norm-stats-in-input-dtype", "lwm_jax/ops/layer_norm.py",
          (("    x32 = x.astype(jnp.float32)\n", "    x32 = x\n"),),
          ("tests/test_fp32_islands.py::test_c_norm_statistics_in_fp32[layer]",),
          "LayerNorm statistics in the input dtype"),
    Plant("group-norm-stats-in-input-dtype", "lwm_jax/ops/group_norm.py",
          (("    xg = x.astype(jnp.float32).reshape(", "    xg = x.reshape("),),
          ("tests/test_fp32_islands.py::test_c_norm_statistics_in_fp32[group]",),
          "GroupNorm (ln_x) statistics in the input dtype"),
    Plant("kk-normalisation-in-input-dtype", "lwm_jax/models/rwkv7/time_mix.py",
          (("    x = x_BTHN.astype(jnp.float32)\n", "    x = x_BTHN\n"),),
          ("tests/test_fp32_islands.py::test_d_kk_normalisation_in_fp32",),
          "normalize_heads in its input's dtype"),
    Plant("logits-in-compute-dtype", "lwm_jax/models/rwkv7/model.py",
          (('return policy.einsum_f32("btc,cv->btv", xo, head_CV)',
            'return policy.einsum("btc,cv->btv", xo, head_CV, out_dtype=jnp.float32)'),
           ('logits = self.policy.einsum_f32("btc,cv->btv", xo, self.head[...])',
            'logits = self.policy.einsum("btc,cv->btv", xo, self.head[...], '
            'out_dtype=jnp.float32)')),
          ("tests/test_fp32_islands.py::test_e_logits_and_loss_in_fp32",),
          "the head matmul on compute-dtype operands (no logits island)"),
    Plant("loss-in-logits-dtype", "lwm_jax/train/loss.py",
          (("    logits = logits_BTV.astype(jnp.float32)\n", "    logits = logits_BTV\n"),),
          ("tests/test_fp32_islands.py::test_e_logits_and_loss_in_fp32",),
          "cross_entropy's logsumexp in the logits' dtype (no loss island)"),
    Plant("overflow-step-not-skipped", "lwm_jax/train/step.py",
          (("        params, opt_state = keep(params, state.params), keep(opt_state, "
            "state.opt_state)\n", ""),),
          ("tests/test_precision.py::test_overflowing_fp16_step_is_skipped",),
          "a non-finite step still applies its update"),
    Plant("kk-gradient-stopped", "lwm_jax/models/rwkv7/time_mix.py",
          (("    return x * jax.lax.rsqrt(jnp.maximum(sumsq, eps * eps))\n",
            "    return x * jax.lax.stop_gradient(jax.lax.rsqrt(jnp.maximum(sumsq, eps * eps)))"
            "\n"),),
          ("tests/models/rwkv7/test_model.py::test_every_preset_forward_backward[fp32]",),
          "a backward-only bug (forward unchanged): invisible when fp32 is compared with itself"),
]


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / name)


def _apply(plant: Plant, dest: Path) -> str | None:
    """Apply the first edit whose snippet occurs exactly once; None if none does."""
    path = dest / plant.file
    text = path.read_text()
    for old, new in plant.edits:
        if text.count(old) == 1:
            path.write_text(text.replace(old, new))
            return old
    return None


def _env(dest: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(dest) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run_tests(dest: Path, tests: tuple[str, ...], timeout: int) -> tuple[int, str]:
    where = subprocess.run([sys.executable, "-c", "import lwm_jax; print(lwm_jax.__file__)"],
                           cwd=dest, env=_env(dest), capture_output=True, text=True)
    if not where.stdout.strip().startswith(str(dest)):
        return 99, f"lwm_jax imported from {where.stdout.strip() or where.stderr}, not the copy"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "--rootdir", str(dest), *tests]
    try:
        done = subprocess.run(cmd, cwd=dest, env=_env(dest), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return 98, f"timed out after {timeout} s"
    return done.returncode, done.stdout + done.stderr


def _evidence(output: str) -> str:
    """The first assertion line of the first failure (pytest's 'E ' lines), plus numpy's
    mismatch summary when there is one (chex / assert_allclose messages)."""
    lines = [ln[1:].strip() for ln in output.splitlines() if re.match(r"^E\s+\S", ln)]
    if not lines:
        tail = [ln for ln in output.splitlines() if ln.strip()]
        return tail[-1][:300] if tail else ""
    extra = [ln for ln in lines[1:40] if ln.startswith(("Mismatched elements",
                                                         "Max absolute difference",
                                                         "Max relative difference"))]
    return " | ".join([lines[0][:300], *extra[:3]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="plants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the plants and exit")
    ap.add_argument("--no-baseline", action="store_true",
                    help="do not first check that the tests pass on the unplanted copy")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    args = ap.parse_args(argv)
    if args.list:
        for p in PLANTS:
            print(f"{p.name:34s} {p.file:30s} {p.what}")
            for t in p.tests:
                print(f"{'':34s}   must fail: {t}")
        return 0
    known = {p.name: p for p in PLANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"unknown plant(s): {', '.join(unknown)}; see --list", file=sys.stderr)
        return 2
    plants = [known[n] for n in args.names] if args.names else PLANTS
    bad = 0
    with tempfile.TemporaryDirectory(prefix="lwm-plant-") as tmp:
        if not args.no_baseline:
            base = Path(tmp) / "baseline"
            _copy_tree(base)
            tests = tuple(dict.fromkeys(t for p in plants for t in p.tests))
            t0 = time.time()
            rc, out = _run_tests(base, tests, args.timeout)
            status = "ok" if rc == 0 else "FAILS"
            print(f"baseline (unplanted, {len(tests)} tests): {status} [{time.time() - t0:.0f} s]",
                  flush=True)
            if rc != 0:
                print(f"  {_evidence(out)}")
                return 1
        for i, plant in enumerate(plants):
            dest = Path(tmp) / f"plant{i}"
            _copy_tree(dest)
            if _apply(plant, dest) is None:
                print(f"STALE     {plant.name}: snippet not found once in {plant.file}",
                      flush=True)
                bad += 1
                continue
            t0 = time.time()
            rc, out = _run_tests(dest, plant.tests, args.timeout)
            status = {0: "SURVIVED", 1: "KILLED"}.get(rc, f"ERROR rc={rc}")
            bad += status != "KILLED"
            print(f"{status:9s} {plant.name} [{time.time() - t0:.0f} s]", flush=True)
            print(f"          {_evidence(out)}", flush=True)
            shutil.rmtree(dest, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
