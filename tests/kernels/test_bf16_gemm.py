"""The bf16-activation GEMM on AMX-BF16 (kernels/cpu/a8_gemm_amx_bf16.cpp, cpu_activations "bf16")
against its torch reference and the exact product, and its refusal on CPUs without AMX-BF16.

Kernel tests run only where the CPU has AMX-BF16 (a Sapphire Rapids or later Xeon); the refusal
tests run everywhere. Awkward shapes: M below, at and past the 16-row tile and its pairs (1, 5,
16, 17, 33, 40), N not a multiple of the 16-column tile, K = 576 and 1536, groups 16 (int8), 32,
64 and 128, fp16 and fp32 scales. Inputs are random and off-centre.
"""

import pytest
import torch
from a8_cases import a8_weight, a8_x

from kernels import cpu_a8, cpu_ops, dispatch
from kernels.reference import bf16_gemm_reference

HAS_BF16 = cpu_ops.available() and cpu_a8.isa_supported(cpu_a8.BF16_ISA)
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AMX-BF16 (or the C++ ops do not build)")


def _bound(x, weight):
    """fp32 summation error of K products: a few ulps of the sum of their magnitudes."""
    return 1e-5 * (x.abs() @ weight.dequantize(torch.float32).abs().t()) + 1e-6


@needs_bf16
@pytest.mark.parametrize("fmt,group,mins,n,k", [("int4", 32, True, 37, 576), ("int4", 64, True, 130, 576),
                                                ("int4", 128, True, 19, 1536), ("int8", 16, False, 37, 576),
                                                ("int8", 32, True, 130, 1536), ("int8", 128, False, 50, 1536)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 40])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_bf16_gemm_matches_reference(fmt, group, mins, n, k, m, scale_dtype):
    weight = a8_weight(fmt, n, k, group, seed=n + m + group, mins=mins, scale_dtype=scale_dtype)
    x = a8_x(m, k, seed=m)
    out = cpu_a8.a8_linear(x, cpu_a8.prepare_a8(weight, bf16=True))
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # Same bf16 rounding of x and of each weight: equal up to the fp32 sums' rounding.
    assert ((out - bf16_gemm_reference(x, weight)).abs() <= _bound(x, weight)).all()


@needs_bf16
@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int8", 16)])
def test_bf16_gemm_is_near_the_exact_product(fmt, group):
    """Against fp32 x @ W.T (an oracle that shares nothing with the kernel): bf16 keeps 8
    significant bits of each value, so a dot product of K random terms is off by ~2^-9 / sqrt-ish
    of its size, far below the weight format's own error."""
    weight = a8_weight(fmt, 96, 576, group, seed=3)
    x = a8_x(24, 576, seed=4)
    exact = x @ weight.dequantize(torch.float32).t()
    out = cpu_a8.a8_linear(x, cpu_a8.prepare_a8(weight, bf16=True))
    assert float((out - exact).norm() / exact.norm()) < 5e-3


@needs_bf16
def test_bf16_rows_do_not_depend_on_the_batch():
    """A row's outputs are the same bits alone as in a batch of 40 (other rows, other tile
    blocks): a request's tokens do not change with the load."""
    weight = a8_weight("int4", 70, 576, 32, seed=5)
    prepared = cpu_a8.prepare_a8(weight, bf16=True)
    x = a8_x(40, 576, seed=6)
    batch = cpu_a8.a8_linear(x, prepared)
    for r in (0, 17, 39):
        assert torch.equal(cpu_a8.a8_linear(x[r:r + 1], prepared)[0], batch[r])


@pytest.mark.parametrize("mode", ["bf16", "bf16-prompts"])
def test_bf16_modes_are_refused_without_amx_bf16(monkeypatch, mode):
    monkeypatch.setattr(cpu_a8, "isa_supported", lambda isa: False)
    with pytest.raises(ValueError, match=f"cpu_activations {mode} needs a CPU with AMX-BF16"):
        dispatch.resolve_cpu_activations(mode, torch.device("cpu"))


def test_bf16_is_one_term_on_the_a8_path():
    with pytest.raises(ValueError, match="one term"):
        dispatch.Backend(torch.device("cpu"), "int4_cpu", cpu_ops=True, triton=False, fused_step_max_tokens=0,
                         int8_activations=True, a8_terms=2, a8_bf16=True)
    with pytest.raises(ValueError, match="terms"):
        cpu_a8.prepare_a8(a8_weight("int4", 16, 64, 32, seed=1), terms=2, bf16=True)
    # Where the a8 path does not run (reference linears), bf16 is dropped with it.
    backend = dispatch.choose_backend("reference", "cpu", int8_activations=True, a8_bf16=True)
    assert not backend.a8_bf16 and not backend.int8_activations


@needs_bf16
def test_bf16_backend_prepares_bf16_weights():
    backend = dispatch.choose_backend("int4_cpu", "cpu", int8_activations=True, a8_bf16=True)
    assert backend.a8_bf16
    prepared = dispatch.prepare_linear(a8_weight("int4", 40, 576, 32, seed=2), backend)
    assert prepared.path == "a8_cpu" and prepared.kernel.bf16
    x = a8_x(3, 576, seed=3)
    expected = bf16_gemm_reference(x, a8_weight("int4", 40, 576, 32, seed=2))
    assert torch.allclose(dispatch.linear(x, prepared), expected, rtol=1e-5, atol=1e-4)
