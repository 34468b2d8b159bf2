"""Random weights and activations for the CPU GEMM tests (tests/kernels/test_a8_gemm.py,
test_bf16_gemm.py): off-centre values, int8 codes over their full range (-128 included, which
GGUF Q8_0 can hold), an outlier and a zero row in x."""

from dataclasses import replace

import torch

from quant.formats import QuantizedTensor, quantize_int4, quantize_int8


def a8_weight(fmt: str, n: int, k: int, group: int, seed: int, mins: bool = False,
              scale_dtype: torch.dtype = torch.float16) -> QuantizedTensor:
    """An int4 (always with mins) or int8 (mins where asked) weight of random values."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) * 0.2 + 0.05
    if fmt == "int4":
        w = quantize_int4(dense, group)
        return replace(w, scales=w.scales.to(scale_dtype), mins=w.mins.to(scale_dtype))
    w = quantize_int8(dense, group)
    qweight = w.qweight.clone()
    qweight[0, :3] = -128  # the one code quantize_int8 never makes
    extra = (torch.rand(n, k // group, generator=gen) - 0.5).to(scale_dtype) if mins else None
    return replace(w, qweight=qweight, scales=w.scales.to(scale_dtype), mins=extra)


def a8_x(m: int, k: int, seed: int) -> torch.Tensor:
    """(m, k) activations with an outlier in row 0 and, from 3 rows on, a zero row 2."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2 + 0.3
    x[0, 5] = 9.0  # an outlier: the row's scale follows it
    if m > 2:
        x[2] = 0.0  # a zero row: scale 0
    return x
