"""`fp8-mixed` met by the real TPU compiler (libtpu on this CPU host) and by XLA:CPU: how many
of the compiled train step's matmuls keep float8 operands, and the line `lwm-jax compile`
prints about it."""
import jax
import pytest

from lwm_jax.aot.cli import fp8_line
from lwm_jax.aot.plan import compile_plan, matmul_operand_types
from lwm_jax.aot.topology import topology_devices
from lwm_jax.train.config import load_config

TINY_FP8 = ["precision=fp8-mixed", "model.n_layer=2", "model.n_embd=128",
            "runtime.scan_layers=false", "train.batch_size=8"]


def test_matmul_operand_types_reads_compiled_hlo():
    text = """
  %p0 = f8e4m3fn[4,8]{1,0} parameter(0)
  %p1 = f8e4m3fn[8,2]{1,0} parameter(1)
  %g = f8e5m2[4,2]{1,0} fusion(%x), kind=kLoop
  %a = bf16[4,8]{1,0} parameter(2)
  %dot.1 = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %convolution.2 = f32[4,8]{1,0} convolution(%g, %p1), window={size=1}, dim_labels=bf_io->bf
  %dot.3 = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={1}
"""
    assert matmul_operand_types(text) == {"f8e4m3fn x f8e4m3fn": 1, "f8e5m2 x f8e4m3fn": 1,
                                          "bf16 x bf16": 1}


@pytest.mark.tpu_compile
def test_tpu_keeps_every_fp8_gemm_in_float8():
    """2 layers x 6 block GEMMs x 3 products (forward, two gradients) = 36 float8 matmuls in
    the step XLA:TPU compiles for a v5e slice; the line says so."""
    cfg = load_config(None, TINY_FP8)
    plan = compile_plan(cfg, topology_devices("v5litepod-4"), target="v5litepod-4",
                        with_eval=False)
    ops = plan.train.matmul_operands
    assert sum(n for k, n in ops.items() if "f8" in k) == 36, ops
    assert ops.get("f8e4m3fn x f8e4m3fn") == 12, ops
    line = fp8_line(ops, plan.device_kind)
    assert line.startswith("FP8 GEMMs: 36 of ") and "float8 operands on TPU v5" in line


def test_cpu_widens_the_fp8_gemms_and_says_so():
    """XLA:CPU emulates FP8 by widening the operands (the values keep FP8's rounding): none of
    its matmuls take float8 operands, and the line says the policy gains no speed there. The
    recurrent WKV: the WKV holds no FP8 GEMM, and XLA:CPU compiles that step faster than the
    chunked one's."""
    assert jax.default_backend() == "cpu"
    cfg = load_config(None, [*TINY_FP8, "runtime.wkv_impl=recurrent"])
    plan = compile_plan(cfg, jax.devices()[:1], with_eval=False)
    ops = plan.train.matmul_operands
    assert ops and not any("f8" in k for k in ops), ops
    assert "none of the" in fp8_line(ops, plan.device_kind)
