"""The compiled-step pre-flight: XLA's memory analysis of the train step (activations included)
is checked against the device's memory before the first step runs, and a step that cannot fit
ends in one line naming the keys that shrink it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from lwm_jax.cli import main as cli_main
from lwm_jax.train.config import load_config
from lwm_jax.train.preflight import check_step_fits, compile_step, step_bytes
from lwm_jax.train.trainer import build_program

SMALL = ["model.n_layer=2", "model.n_embd=64", "train.ctx_len=64", "train.batch_size=4",
         "train.eval_every=0", "train.steps=2", "train.warmup_steps=1"]


@pytest.fixture(scope="module")
def small_run():
    """`(cfg, program, state, tokens)` of the SMALL config (batch 4), shared by the tests
    below: its train step is compiled once (jit's cache) however many of them lower it."""
    cfg = load_config(None, SMALL)
    prog = build_program(cfg)
    state = prog.init_state()
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 65), 0, cfg.model.vocab_size)
    return cfg, prog, state, tokens


def test_the_analysis_counts_activations_and_grows_with_the_batch(small_run):
    """Batch 4, and batch 16 compiled from the state's shapes alone (as `train` compiles the
    step before it initialises the state)."""
    _, prog, state, tokens = small_run
    small = step_bytes(prog.train_step.lower(state, tokens).compile())
    assert small is not None and small["temp"] > 0
    assert small["peak"] == small["arguments"] + small["outputs"] - small["aliased"] + small["temp"]
    prog16 = build_program(load_config(None, [*SMALL, "train.batch_size=16"]))
    tokens16 = jax.ShapeDtypeStruct((16, 65), tokens.dtype)
    big = step_bytes(prog16.train_step.lower(prog16.abstract_state, tokens16).compile())
    assert big["temp"] > 2 * small["temp"]            # activations scale with the batch
    assert big["arguments"] - small["arguments"] == 12 * 65 * 4   # only the int32 tokens grew


def test_a_step_that_does_not_fit_is_refused_in_one_line(small_run):
    cfg, prog, state, tokens = small_run
    need = step_bytes(prog.train_step.lower(state, tokens).compile())["peak"]
    with pytest.raises(ValueError) as err:
        compile_step(cfg, prog.train_step, state, tokens, memory=(need // 2, "test memory"))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("train.batch_size=4, train.ctx_len=64: the compiled train step needs")
    assert "test memory" in msg and "runtime.remat=true" in msg and "train.grad_accum" in msg
    # enough memory: the compiled step is returned and trains (on a copy of the shared state:
    # the step donates its state's buffers)
    step = compile_step(cfg, prog.train_step, state, tokens, memory=(4 * need, "test memory"))
    state, metrics = step(jax.tree.map(jnp.array, state), tokens)
    assert int(state.step) == 1 and float(metrics["finite"]) == 1


def test_a_refused_step_names_the_remat_knobs_left_to_turn():
    usage = {"peak": 10**12, "arguments": 0, "temp": 10**12}

    def message(*overrides):
        with pytest.raises(ValueError) as err:
            check_step_fits(load_config(None, [*SMALL, *overrides]), usage, 10**9, "x")
        return str(err.value)
    assert "set runtime.remat=true" in message("runtime.remat=false")
    partial = message("runtime.remat=true", "runtime.remat_policy=save_dots",
                      "runtime.remat_layers=1")
    assert "raise runtime.remat_layers=1 (-1: every block)" in partial
    assert "set runtime.remat_policy=full" in partial and "remat=true" not in partial
    every = message("runtime.remat=true", "runtime.remat_policy=full")
    assert "remat_layers" not in every and "remat_policy" not in every


def test_unknown_sizes_never_refuse():
    cfg = load_config(None, SMALL)
    check_step_fits(cfg, None, 1, "x")
    check_step_fits(cfg, {"peak": 10**15, "arguments": 0, "temp": 0}, None, "x")


def test_the_cli_refuses_before_the_state_is_initialised(tmp_path, monkeypatch, capsys):
    """The step is compiled and checked from shapes alone: a run that cannot fit is refused
    without waiting for the state's initialisation (minutes for billions of parameters)."""
    import lwm_jax.train.preflight as preflight
    from lwm_jax.train.trainer import TrainProgram
    monkeypatch.setattr(preflight, "device_memory", lambda: (1 << 20, "memory of one test device"))
    initialised = []
    monkeypatch.setattr(TrainProgram, "init_state", lambda self: initialised.append(1))
    status = cli_main(["train", "--no-progress", *SMALL, f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "memory of one test device" in err[0] and "train.batch_size=4" in err[0]
    assert not initialised


class _FakeGpu:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def memory_stats(self):
        return {"bytes_limit": 63_761_000_000}


def test_on_a_gpu_the_default_memory_fraction_is_named_with_its_fix(monkeypatch):
    """JAX gives itself 75% of a GPU by default: a refused step's line says so and how to raise
    it (the 0.1B step at 524288 tokens fits an H100 only with more), and not when it is set."""
    import lwm_jax.train.preflight as preflight
    monkeypatch.setattr(preflight.jax, "local_devices", lambda: [_FakeGpu()])
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    have, what = preflight.device_memory()
    assert have == 63_761_000_000 and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in what
    cfg = load_config(None, SMALL)
    with pytest.raises(ValueError, match="default 75% of it: set XLA_PYTHON_CLIENT_MEM_FRACTION"):
        check_step_fits(cfg, {"peak": have, "arguments": 0, "temp": have}, have, what)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert preflight.device_memory() == (have, "memory of one NVIDIA H100 80GB HBM3")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert "FRACTION" not in preflight.device_memory()[1]
