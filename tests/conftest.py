"""Shared test set-up: the `gpu` marker skips off-GPU, `gpu_path` marks the files a GPU runs
differently (`GPU_PATH_FILES`), and fixtures for WKV7 problems.

Layout: `tests/` mirrors the package (`tests/ops/wkv7/`, `tests/models/rwkv7/`, `tests/train/`,
...); cross-cutting suites (bad inputs, CLI, precision islands, planted-bug survivors) stay at
the top. Test file names are unique across folders (pytest's default import mode needs it).
"""
from __future__ import annotations

import atexit
import glob
import importlib.util
import os
import shutil
import tempfile

# `lwm-jax train` turns on JAX's persistent compilation cache, by default under the user's cache
# directory (`lwm_jax.train.compile_cache`): tests that run it, in-process or as a subprocess,
# would leave their programs there, and a later run of the suite would load them (warm where a
# clean machine is cold, and files left in the home directory). The test run gets its own
# directory (pytest-xdist workers inherit it from the main process), removed at exit, unless the
# environment names one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _COMPILE_DIR = tempfile.mkdtemp(prefix="lwm-jax-tests-compile-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_DIR
    atexit.register(shutil.rmtree, _COMPILE_DIR, ignore_errors=True)

# Two pytest-xdist workers share one GPU: with JAX's default preallocation each takes 75% of it
# at its first array. On an H100 a WKV-state test failed that way and passed alone; allocating
# on demand, both workers pass (benchmarks/RESULTS.md, 2026-11-26). An explicit setting in the
# environment still wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _no_accelerator() -> bool:
    """No NVIDIA driver and no TPU device on this host, or JAX told to use the CPU."""
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return True
    return not os.path.exists("/proc/driver/nvidia/version") and not glob.glob("/dev/accel*")


# On a CPU-only host (CI) the suite's time is mostly XLA:CPU compiling small programs, in this
# process and in the subprocesses that inherit the environment. LLVM at optimisation level 0
# compiles them faster and runs them slower, a net gain here (tests/models/rwkv7/test_model.py
# 102 -> 70 s on two cores; the whole suite in benchmarks/RESULTS.md, "CPU test suite"). XLA:CPU
# uses no fast-math at either level, and the TPU programs `lwm-jax compile` builds through
# libtpu come out with the same memory and cost analyses. Not with an accelerator (its XLA
# kernels would be compiled unoptimised), and an XLA_FLAGS that sets the level itself wins.
# A subprocess given XLA_FLAGS of its own (a device count) gets them from `subprocess_env`,
# which keeps this level; the same fixture leaves it out for a subprocess that mostly runs.
_LEVEL_0 = "--xla_backend_optimization_level=0"
_SETS_LEVEL_0 = (_no_accelerator()
                 and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""))
if _SETS_LEVEL_0:
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), _LEVEL_0]).strip()

import jax  # noqa: E402  (after the allocator and compiler settings above)
import jax.extend  # noqa: E402
import pytest  # noqa: E402

from lwm_jax.hardware import skip_absent_tpu  # noqa: E402

# libtpu is installed for the TPU compile tests; on a host with no TPU (CI) JAX would otherwise
# start the TPU runtime, fail, and print its log on stderr before using the CPU.
skip_absent_tpu()

ON_GPU = jax.default_backend() == "gpu"

# Test files that run code on a GPU that a CPU never runs: Pallas kernels compiled by Triton,
# cuDNN attention, TF32 / bf16 GEMMs under each precision policy, the fp32 islands and the
# hand-written backward rules around them, the kernels' auto choice, GPU training and FLA
# interop. Their tests get the `gpu_path` marker; they run everywhere, and on a GPU
# `python -m pytest -m "gpu or gpu_path"` runs all of them (README, "Tests on a GPU").
# A file belongs here when its results could differ on a GPU; TPU-interpreter tests do not.
GPU_PATH_FILES = (
    "tests/ops/wkv7/test_wkv7_pallas.py", "tests/ops/wkv7/test_wkv7_pallas_pair.py",
    "tests/ops/wkv7/test_wkv7_chains.py",
    "tests/ops/wkv7/test_wkv7_ops.py", "tests/ops/wkv7/test_wkv7_aligned_keys.py",
    "tests/ops/wkv7/test_wkv7_limits.py", "tests/ops/wkv7/test_wkv_precision.py",
    "tests/ops/wkv7/test_tf32_round.py",
    "tests/ops/test_xent.py", "tests/ops/test_layer_norm.py", "tests/ops/test_group_norm.py",
    "tests/ops/test_relu2_matmul.py", "tests/ops/test_kernels_per_device.py",
    "tests/layers/test_attention.py", "tests/layers/test_norms.py",
    "tests/layers/test_rms_norm.py", "tests/layers/test_rope.py",
    "tests/models/rwkv7/test_model.py", "tests/models/rwkv7/test_kk_normalise.py",
    "tests/models/rwkv7/test_squared_relu.py", "tests/models/rwkv7/test_fp16_channel_mix.py",
    "tests/models/llama/test_llama_model.py", "tests/models/hybrid/test_hybrid.py",
    "tests/models/hybrid/test_hybrid_reference.py",
    "tests/test_fp32_islands.py", "tests/test_precision.py", "tests/test_bf16_split.py",
    "tests/train/test_fused_loss.py", "tests/interop/test_fla_interop.py",
)


def pytest_terminal_summary(terminalreporter):
    """The TPU compiles of the run (tests that call `lwm_jax.aot.testing.report`), one line
    each: generation, what, Mosaic kernels in the program, temporaries, scoped VMEM, seconds."""
    lines = sorted(value for report in terminalreporter.getreports("passed")
                   for name, value in getattr(report, "user_properties", ())
                   if name == "tpu_compile" and report.when == "call")
    if lines:
        terminalreporter.write_sep("-", f"TPU compile (XLA:TPU + Mosaic via libtpu, no TPU): "
                                        f"{len(lines)} programs")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    """Files with a test marked `slow` run first, each file's tests kept together
    (longest-first keeps the two xdist workers busy to the end instead of leaving one idle
    behind a long test collected last; a file kept whole stays on one worker, so its
    module-scoped fixtures are built once, not once per worker: the sequence-parallel file's
    took ~65 s twice when its one fast test was sorted away from its slow ones). Tests marked
    `gpu` need compiled CUDA kernels: skip them cleanly elsewhere."""
    gpu_path = pytest.mark.gpu_path
    for item in items:
        if item.path.relative_to(config.rootpath).as_posix() in GPU_PATH_FILES:
            item.add_marker(gpu_path)
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)       # stable: order kept otherwise
    if importlib.util.find_spec("libtpu") is None:
        # A GPU machine installed with [gpu] has no libtpu: its TPU compile tests skip there.
        # CI installs [tpu] and must run them: a CI without libtpu fails instead of skipping.
        if os.environ.get("CI", "").lower() in ("1", "true"):
            raise pytest.UsageError("CI: libtpu is not installed, but the TPU compile tests "
                                    "must run; install with pip install -e '.[dev,tpu]'")
        skip_tpu = pytest.mark.skip(reason="needs libtpu (pip install -e '.[tpu]')")
        for item in items:
            if "tpu_compile" in item.keywords:
                item.add_marker(skip_tpu)
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.default_backend() is "
                                   f"{jax.default_backend()!r})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def on_cpu():
    """Run the test on the CPU whatever accelerator the host has: for Pallas' TPU interpreter,
    whose float32 results are compared at CPU tolerances (on a GPU its matmuls would take the
    GPU's default TF32 precision, and the interpreter there tests nothing a TPU runs)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def wkv7_problem():
    """`make(seed, B, T, H, K, V=K, dtype=float32) -> (r, w, k, v, a, b)`: fresh RWKV-7-like
    random inputs (`lwm_jax.ops.wkv7.testing.random_wkv7_inputs`), never zeros."""
    import jax.numpy as jnp
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs

    def make(seed, B, T, H, K, V=None, dtype=jnp.float32):
        return random_wkv7_inputs(seed, B, T, H, K, K if V is None else V, dtype)
    return make


def _eqns_named(jaxpr, name: str) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _eqns_named(sub, name)
    return found


@pytest.fixture
def jaxpr_eqns():
    """`find(jaxpr, primitive_name) -> [eqn, ...]`: every equation of that primitive in the
    jaxpr and, recursively, in the jaxprs its equations carry (pjit, custom_vjp, scan, ...)."""
    return _eqns_named


def _benchmark_script(name: str):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def benchmark_script():
    """`load(name) -> module`: the script `benchmarks/<name>.py`, imported by path (benchmarks/
    is a folder of scripts, not a package)."""
    return _benchmark_script


def _subprocess_env(n_devices: int = 1, *, optimised: bool = False,
                    **extra: str) -> dict[str, str]:
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_force_host_platform_device_count")
             and not (optimised and _SETS_LEVEL_0 and flag == _LEVEL_0)]
    if n_devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={n_devices}")
    return {**os.environ, "XLA_FLAGS": " ".join(flags), **extra}


@pytest.fixture(scope="session")
def subprocess_env():
    """`env(n_devices=1, optimised=False, **extra) -> dict`: this process's environment for a
    subprocess that runs JAX on the CPU, with `extra` added. XLA_FLAGS keeps the run's flags
    (the optimisation level set above) with `--xla_force_host_platform_device_count=n_devices`
    in place of any device count (none for one device): an XLA_FLAGS of the device count alone
    would run those subprocesses at XLA:CPU's default level, compiling slower (figures:
    benchmarks/RESULTS.md, "CPU test suite"). `optimised=True` leaves out the level set above
    (XLA:CPU's default level; a level the environment set itself is kept), for a subprocess
    that runs more than it compiles."""
    return _subprocess_env


@pytest.fixture(params=["interpret"] + (["compiled"] if ON_GPU else []))
def pallas_mode(request):
    """Run a Pallas test in the interpreter (everywhere) and compiled (on a GPU): yields the
    `interpret` flag to pass to the kernel."""
    return request.param == "interpret"
