"""The int8-activation CPU GEMMs (kernels.cpu_a8) against their torch reference, on every
instruction set this CPU runs (the others are skipped, so a CPU without VNNI passes too).

Awkward shapes: M not a multiple of the kernels' row blocks (4, 8 and AMX's 16, which runs from
16 rows: below, its ISA runs the AVX512-VNNI kernel), N not a multiple of the
16-column tile, K = 576 and 1536 (SmolLM2-135M's), groups 16 (int8), 32, 64 and 128. Inputs are
random and off-centre; int8 codes cover their full range, -128 included (GGUF Q8_0 can hold it).
"""


import pytest
import torch
from a8_cases import a8_weight, a8_x

from kernels import cpu_a8, cpu_ops
from kernels.reference import (
    bf16_gemm_reference,
    int4_gemm_reference,
    int8_activation_gemm_reference,
    int8_gemm_reference,
)
from quant.formats import quantize_int8

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")

RUNNABLE = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_ops.available() or not cpu_a8.isa_supported(isa),
                                                       reason=f"this CPU cannot run {isa}"))
            for isa in cpu_a8.ISAS]


SHAPES = [(37, 576, 32), (50, 576, 64), (19, 1536, 128), (130, 1536, 32)]


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 9, 16, 19, 40])
def test_a8_gemm_matches_reference(isa, fmt, n, k, group, m):
    weight = a8_weight(fmt, n, k, group, seed=n + m)
    x = a8_x(m, k, seed=m)
    out = cpu_a8.a8_linear(x, cpu_a8.prepare_a8(weight), isa)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    reference = int8_activation_gemm_reference(x, weight)
    # Same int8 rounding of x, exact integer dots: equal up to fp32 rounding of the unit sums.
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4 * float(reference.abs().max()))
    # Against the exact product: int8 activations (a scale per 32) cost ~1%, on these Gaussian rows.
    exact = (int4_gemm_reference if fmt == "int4" else int8_gemm_reference)(x, weight)
    assert float((out - exact).norm() / exact.norm()) < 0.05


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("fmt,group,mins", [("int4", 32, True), ("int4", 64, True), ("int8", 16, True),
                                            ("int8", 32, False)])
@pytest.mark.parametrize("m", [1, 3, 10, 37])  # 37: rows quantized on both threads
def test_two_term_activations_match_reference_and_come_near_the_exact_product(isa, fmt, group, mins, m):
    weight = a8_weight(fmt, 45, 576, group, seed=m + group, mins=mins)
    x = a8_x(m, 576, seed=m + 7)
    out = cpu_a8.a8_linear(x, cpu_a8.prepare_a8(weight, terms=2), isa)
    reference = int8_activation_gemm_reference(x, weight, terms=2)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4 * float(reference.abs().max()))
    exact = (int4_gemm_reference if fmt == "int4" else int8_gemm_reference)(x, weight)
    one_term = cpu_a8.a8_linear(x, cpu_a8.prepare_a8(weight), isa)
    two, one = float((out - exact).norm() / exact.norm()), float((one_term - exact).norm() / exact.norm())
    # The residual's codes, on a sixteenth of the codes' grid, take the error from ~1% to ~0.07%.
    assert two < 1e-3 and two < one / 8


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int4", 64), ("int8", 32)])
@pytest.mark.parametrize("m", [2, 5, 19])
def test_two_term_rows_in_a_batch_equal_each_row_alone(isa, fmt, group, m):
    # One row runs the per-term loop; from two rows the AVX512-VNNI kernel sums int4 weights' two
    # terms in one multiply-add chain (rows_fold). Both are the same exact int32 sum and rescale,
    # so a row's output does not depend on its batch, bit for bit.
    weight = cpu_a8.prepare_a8(a8_weight(fmt, 45, 576, group, seed=m, mins=True), terms=2)
    x = a8_x(m, 576, seed=m + 3)
    batch = cpu_a8.a8_linear(x, weight, isa)
    alone = torch.cat([cpu_a8.a8_linear(x[i:i + 1], weight, isa) for i in range(m)])
    assert torch.equal(batch, alone)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("group,mins", [(16, False), (16, True), (32, True), (128, False)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_a8_gemm_int8_groups_and_mins(isa, group, mins, scale_dtype):
    weight = a8_weight("int8", 45, 1536, group, seed=group, mins=mins, scale_dtype=scale_dtype)
    x = a8_x(11, 1536, seed=group)
    out = cpu_a8.a8_linear(x, cpu_a8.prepare_a8(weight), isa)
    reference = int8_activation_gemm_reference(x, weight)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4 * float(reference.abs().max()))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_tiles_keep_fp16_params_and_run_fp32_ones(isa, fmt):
    """A GGUF's fp16 scales and mins stay fp16 in the tiles (20 bytes per 32 int4 weights, the int8
    code sums int16); fp32 and bf16 ones run as fp32, exactly, on the same kernels."""
    x = a8_x(7, 576, seed=5)
    kept_as = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16))
    for dtype, kept in kept_as:
        weight = a8_weight(fmt, 33, 576, 32, seed=6, mins=True, scale_dtype=dtype)
        a8 = cpu_a8.prepare_a8(weight)
        assert a8.scales.dtype == kept and a8.mins.dtype == kept
        out = cpu_a8.a8_linear(x, a8, isa)
        reference = int8_activation_gemm_reference(x, weight)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4 * float(reference.abs().max()))
    tiles = -(-33 // cpu_a8.COLS) * cpu_a8.COLS
    if fmt == "int4":  # the fp16 weight: codes, an fp16 scale and min per 32
        assert a8.nbytes == tiles * 576 // 2 + 2 * 2 * tiles * 576 // 32
    else:
        assert a8.wsum.dtype == torch.int16 and a8.nbytes == tiles * 576 + 3 * 2 * tiles * 576 // 32


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("n,k", [(37, 512), (130, 1536)])
@pytest.mark.parametrize("m,terms", [(1, 2), (5, 1), (19, 2), (40, 1)])
def test_q4_k_runs_on_its_two_levels(isa, n, k, m, terms):
    """A GGUF Q4_K weight keeps the file's two levels in the tiles (18.5 bytes per 32 weights, not
    the fp16 products' 20) and computes with their exact products, not the fp16-rounded ones."""
    from dataclasses import replace

    from gguf_packing import random_blocks

    from quant.gguf_blocks import DECODERS
    from quant.gguf_reader import GGMLType

    weight = DECODERS[GGMLType.Q4_K](random_blocks("Q4_K", n, k, seed=n + k), n, k)
    a8 = cpu_a8.prepare_a8(weight, terms)
    tiles = -(-n // cpu_a8.COLS)
    assert a8.scales.dtype == a8.mins.dtype == torch.uint8
    assert a8.nbytes == tiles * cpu_a8.COLS * k // 2 + 2 * tiles * (k // 256) * (2 * 16 + 8 * 16)
    x = a8_x(m, k, seed=m)
    out = cpu_a8.a8_linear(x, a8, isa)
    reference = int8_activation_gemm_reference(x, weight, terms)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    products = int8_activation_gemm_reference(x, replace(weight, super_scales=None), terms)
    assert float((products - reference).abs().max()) > 1e-4 * float(reference.abs().max())  # the test can tell
    if cpu_a8.isa_supported("amx_bf16") and isa == cpu_a8.ISAS[0]:
        bf16 = cpu_a8.a8_linear(x, cpu_a8.prepare_a8(weight, bf16=True))
        assert float((bf16 - bf16_gemm_reference(x, weight)).abs().max()) < 1e-4 * float(reference.abs().max())


def test_isas_agree_and_the_default_is_the_best():
    runnable = [isa for isa in cpu_a8.ISAS if cpu_a8.isa_supported(isa)]
    assert "avx2" in runnable and cpu_a8.default_isa() in runnable
    weight = cpu_a8.prepare_a8(a8_weight("int4", 70, 576, 32, seed=1))
    for m in (13, 40):  # 40: AMX's own kernel (from 16 rows)
        x = a8_x(m, 576, seed=2)
        outs = [cpu_a8.a8_linear(x, weight, isa) for isa in runnable]
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available() or not cpu_a8.isa_supported("amx"), reason="this CPU cannot run amx")
@pytest.mark.parametrize("fmt,group,mins,terms,k", [("int4", 32, True, 1, 576), ("int4", 64, True, 2, 576),
                                                    ("int8", 16, True, 1, 576), ("int8", 32, False, 2, 576),
                                                    ("int4", 32, True, 2, 576), ("int8", 16, True, 2, 576),
                                                    ("int4", 128, True, 2, 1536), ("int8", 64, True, 2, 1536)])
@pytest.mark.parametrize("m", [12, 37])  # 12 two-term rows: the fewest AMX takes, 3/4 of a block
def test_amx_equals_avx512vnni_bit_for_bit(fmt, group, mins, terms, k, m):
    """The same integer dots and the same fp32 sums in the same order: one-term int8 activations
    turn a last-bit difference into whole codes a layer later (eval-ppl 46.83 -> 47.01 once, with
    the mins' term added after the unit's product instead of before)."""
    raw = a8_weight(fmt, 100, k, group, seed=9, mins=mins)
    weight = cpu_a8.prepare_a8(raw, terms)
    x = a8_x(m, k, seed=10)
    out = cpu_a8.a8_linear(x, weight, "amx")
    assert torch.equal(out, cpu_a8.a8_linear(x, weight, "avx512vnni"))
    reference = int8_activation_gemm_reference(x, raw, terms)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4 * float(reference.abs().max()))


def test_run_isa_names_the_kernel_each_row_count_runs():
    """AMX takes 16 one-term or 12 two-term rows and more (a folded block holds 16 rows of x); below,
    "amx" runs the AVX512-VNNI kernel; the other ISAs run as asked at every row count."""
    expected = {(1, 1): "avx512vnni", (15, 1): "avx512vnni", (16, 1): "amx", (300, 1): "amx",
                (1, 2): "avx512vnni", (11, 2): "avx512vnni", (12, 2): "amx", (16, 2): "amx"}
    assert {key: cpu_a8.run_isa("amx", *key) for key in expected} == expected
    for isa in ("avx512vnni", "avxvnni", "avx2"):
        assert {cpu_a8.run_isa(isa, rows, terms) for rows in (1, 12, 16, 300) for terms in (1, 2)} == {isa}
    with pytest.raises(RuntimeError, match="terms must be 1 or 2"):
        cpu_a8.run_isa("amx", 16, 3)


def test_isa_override(monkeypatch):
    monkeypatch.setenv(cpu_a8.ISA_ENV, "avx2")
    assert cpu_a8.default_isa.__wrapped__() == "avx2"
    monkeypatch.setenv(cpu_a8.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="EDGEINFER_CPU_ISA"):
        cpu_a8.default_isa.__wrapped__()


def test_auto_activations_are_bf16_prompts_with_amx_bf16_int8x2_lean_with_vnni_else_int16(monkeypatch):
    from kernels.dispatch import resolve_cpu_activations

    cpu = torch.device("cpu")
    for isa, bf16, expected in (("amx", True, "bf16-prompts"), ("amx", False, "int8x2-lean"),
                                ("avx512vnni", True, "int8x2-lean"), ("avx512vnni", False, "int8x2-lean"),
                                ("avxvnni", False, "int8x2-lean"), ("avx2", False, "int16")):
        monkeypatch.setattr(cpu_a8, "default_isa", lambda isa=isa: isa)
        monkeypatch.setattr(cpu_a8, "isa_supported", lambda name, bf16=bf16: bf16 or name != cpu_a8.BF16_ISA)
        assert resolve_cpu_activations("auto", cpu) == expected
        assert resolve_cpu_activations("int8", cpu) == "int8"  # asked for: as asked
    assert resolve_cpu_activations("auto", torch.device("cuda")) == "int16"  # the CPU kernels' setting only


def test_unsupported_weights_and_shapes_raise():
    with pytest.raises(ValueError, match="int8-activation"):
        cpu_a8.prepare_a8(quantize_int8(torch.randn(8, 48), 16))  # K not a multiple of 32
    weight = cpu_a8.prepare_a8(a8_weight("int4", 20, 64, 32, seed=3))
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_a8.a8_linear(torch.randn(2, 32), weight)
    assert cpu_a8.a8_linear(torch.randn(0, 64), weight).shape == (0, 20)


def test_dispatch_runs_a8_for_every_m_where_asked():
    from kernels.dispatch import choose_backend, linear, prepare_linear

    weight = a8_weight("int4", 40, 576, 32, seed=4)
    backend = choose_backend("int4_cpu", "cpu", int8_activations=True)
    assert backend.int8_activations
    prepared = prepare_linear(weight, backend)
    assert prepared.path == "a8_cpu"
    for m in (1, 3, 70):
        x = a8_x(m, 576, seed=m)
        torch.testing.assert_close(linear(x, prepared), int8_activation_gemm_reference(x, weight), rtol=1e-5,
                                   atol=1e-3)
    assert prepare_linear(weight, choose_backend("int4_cpu", "cpu")).path == "int4_cpu"  # int16: the default
    assert not choose_backend("reference", "cpu", int8_activations=True).int8_activations
