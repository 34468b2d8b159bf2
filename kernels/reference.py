"""Plain-torch references for the kernels in kernels/: small, slow and obviously right.

Tests compare every Triton kernel against the function here that it claims to compute. Each
section owns the references of one kernel family; add new families in their own section below.
"""

from __future__ import annotations

import torch

from quant.formats import QuantizedTensor

# ---- weight-only GEMM (kernels.int4_gemm, kernels.int8_gemm) ----------------------------------


def int4_gemm_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequantize(W).T for an int4 weight: fp32 math, output in x's dtype."""
    if weight.format != "int4":
        raise ValueError(f"int4_gemm_reference needs an int4 weight, got {weight.format!r}")
    return (x.float() @ weight.dequantize(torch.float32).t()).to(x.dtype)


def int8_gemm_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequantize(W).T for an int8 weight: fp32 math, output in x's dtype."""
    if weight.format != "int8":
        raise ValueError(f"int8_gemm_reference needs an int8 weight, got {weight.format!r}")
    return (x.float() @ weight.dequantize(torch.float32).t()).to(x.dtype)
