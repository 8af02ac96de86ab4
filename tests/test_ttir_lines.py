"""The offline SASS tools on synthetic inputs: benchmarks/ttir_lines.py (instructions counted per
TTIR line and opcode, each line named as the product operand it feeds) and the TF32 operand
rounding benchmarks/wkv7_ptxas.py puts into the TTIR as XLA's Triton pipeline does."""
from __future__ import annotations

import pytest

_LISTING = """\
wkv7_intra_bwd:
\t//## File "/tmp/x/04_k_w4.ttir", line 2
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/tmp/x/04_k_w4.ttir", line 4
        /*0010*/                   STS [R3], R4 ;
        /*0020*/                   STS [R3+0x4], R5 ;
        /*0030*/                   @!P0 STS.128 [R3+0x10], R8 ;
\t//## File "/tmp/x/04_k_w4.ttir", line 5
        /*0040*/                   STS.128 [R6], R12 ;
        /*0050*/                   LDSM.16.M88.4 R20, [R7] ;
\t//## File "/tmp/x/04_k_w4.ttir", line 7
        /*0060*/                   HGMMA.64x64x8.F32.TF32 R24, gdesc[UR4], RZ ;
        /*0070*/                   @P1 LDS R9, [R2] ;
"""

_TTIR = """\
module {
  tt.func public @k(%arg0: !tt.ptr<f32>) {
    %0 = tt.load %arg0 : tensor<64x64x!tt.ptr<f32>>
    %1 = tt.elementwise_inline_asm "cvt.rn.tf32.f32 $0, $1;" %0 : tensor<64x64xf32>
    %2 = tt.trans %1 {order = array<i32: 1, 0>} : tensor<64x64xf32> -> tensor<64x64xf32>
    %3 = arith.constant dense<0.0> : tensor<64x64xf32>
    %4 = tt.dot %1, %2, %3, inputPrecision = tf32 : tensor<64x64xf32>
    tt.return
  }
}
"""


@pytest.fixture(scope="module")
def tl(benchmark_script):
    return benchmark_script("ttir_lines")


def test_sass_counted_per_ttir_line_and_opcode(tl):
    counts = tl.sass_by_line(_LISTING)
    assert counts[(4, "STS")] == 2 and counts[(4, "STS.128")] == 1   # a predicate is skipped
    assert counts[(5, "STS.128")] == 1 and counts[(5, "LDSM.16.M88.4")] == 1
    assert counts[(7, "HGMMA.64x64x8.F32.TF32")] == 1 and counts[(7, "LDS")] == 1
    assert counts[(2, "LDC")] == 1 and sum(counts.values()) == 8


def test_dot_operands_follow_a_transpose(tl):
    roles = tl.dot_operands(_TTIR)
    assert roles[4] == ["lhs of dot 1", "rhs of dot 1 (before its transpose)"]
    assert roles[5] == ["rhs of dot 1 (transposed)"]
    assert 3 not in roles


def test_attribute_keeps_the_chosen_opcodes_and_names_the_line(tl):
    rows = tl.attribute(tl.sass_by_line(_LISTING), _TTIR, ("STS",))
    assert [r["line"] for r in rows] == [4, 5]
    first = rows[0]
    assert first["counts"] == {"STS": 2, "STS.128": 1}
    assert first["roles"][0] == "lhs of dot 1"
    assert first["op"].startswith("tt.elementwise_inline_asm")
    loads = tl.attribute(tl.sass_by_line(_LISTING), _TTIR, ("LDS",))   # a prefix: LDSM too
    assert [(r["line"], r["counts"]) for r in loads] == [(5, {"LDSM.16.M88.4": 1}),
                                                          (7, {"LDS": 1})]


def test_missing_ttir_is_a_one_line_error(tl, tmp_path):
    with pytest.raises(SystemExit, match="no such file; write it with"):
        tl.main([str(tmp_path / "none.ttir"), "--triton-site", str(tmp_path)])


def test_xla_rounding_wraps_only_unmarked_float32_tf32_dots(benchmark_script):
    """`wkv7_ptxas.xla_tf32_rounding`: what XLA's Triton pipeline adds before the offline compile.
    A float32 TF32 `tt.dot` gets its two operands rounded (ties away) and reads the rounded values;
    a dot marked `tf32_arguments_rounded` (the kernels' own rounding), a bf16 dot and every other
    line pass through unchanged."""
    ptx = benchmark_script("wkv7_ptxas")
    f32 = ("    %5 = tt.dot %1, %2, %3, inputPrecision = tf32 : tensor<64x64xf32> * "
           "tensor<64x64xf32> -> tensor<64x64xf32>")
    bf16 = ("    %6 = tt.dot %7, %8, %5, inputPrecision = tf32 : tensor<64x64xbf16> * "
            "tensor<64x64xbf16> -> tensor<64x64xf32>")
    marked = ("    %9 = tt.dot %1, %2, %3, inputPrecision = tf32 {tf32_arguments_rounded} : "
              "tensor<32x64xf32> * tensor<64x32xf32> -> tensor<32x32xf32>")
    out = ptx.xla_tf32_rounding("\n".join(["module {", f32, bf16, marked, "}"])).splitlines()
    assert out[0] == "module {" and out[-1] == "}" and out[-3:-1] == [bf16, marked]
    assert len(out) == 7
    round_a, round_b, dot = out[1:4]
    assert "cvt.rna.tf32.f32" in round_a and round_a.strip().startswith("%xla_rna_a1 = ")
    assert round_a.endswith("%1 : tensor<64x64xf32> -> tensor<64x64xf32>")
    assert round_b.strip().startswith("%xla_rna_b1 = ") and " %2 : " in round_b
    assert dot.strip().startswith("%5 = tt.dot %xla_rna_a1, %xla_rna_b1, %3, ")
    assert dot.endswith("tensor<64x64xf32> * tensor<64x64xf32> -> tensor<64x64xf32>")
