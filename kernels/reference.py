"""Plain-torch references for the kernels in kernels/: small, slow and obviously right.

Tests compare every Triton kernel against the function here that it claims to compute. Each
section owns the references of one kernel family; add new families in their own section below.
"""

from __future__ import annotations

import torch

from kernels.cpu_a8 import keeps_two_levels
from quant.formats import QuantizedTensor, unpack_int4

# ---- weight-only GEMM (kernels.int4_gemm, kernels.int8_gemm, kernels.cpu_ops) -----------------


def int4_gemm_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequantize(W).T for an int4 weight: fp32 math, output in x's dtype."""
    if weight.format != "int4":
        raise ValueError(f"int4_gemm_reference needs an int4 weight, got {weight.format!r}")
    return (x.float() @ weight.dequantize(torch.float32).t()).to(x.dtype)


def int16_activation_gemm_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """fp32 (M, N): what kernels.cpu_ops computes for an int4 or int8 weight. Each 32-block of x
    splits into 8 groups of 4, group l = values {2l, 2l + 1, 16 + 2l, 17 + 2l}; a group becomes
    int16 codes round(x / d), d = absmax / 32767 (round half to even); each group's integer dot
    with the weight codes is scaled by weight scale x d (groups of 16: the two halves' dots each
    by their own scale), and a weight's min term uses the exact group sums of x."""
    if weight.format not in ("int4", "int8") or weight.shape[1] % 32 or \
            (weight.group_size % 32 and not (weight.format == "int8" and weight.group_size == 16)):
        raise ValueError("int16_activation_gemm_reference needs an int4 or int8 weight with K a multiple of 32 "
                         "and group size 16 (int8) or a multiple of 32")
    n, k = weight.shape

    def lane_groups(t: torch.Tensor) -> torch.Tensor:  # (R, K) -> (R, K / 32, 8, 4)
        return t.reshape(t.shape[0], k // 32, 2, 8, 2).permute(0, 1, 3, 2, 4).reshape(t.shape[0], k // 32, 8, 4)

    x2 = x.float().reshape(-1, k)
    groups = lane_groups(x2)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax, torch.zeros_like(amax))
    xq = torch.round(groups * inv)  # integers in -32767..32767, exact in fp32
    codes = unpack_int4(weight.qweight) if weight.format == "int4" else weight.qweight
    group = weight.group_size
    # Per 16 values (each lane group's two halves apart): integer sums below 2**24, exact.
    dots = torch.einsum("mbghi,nbghi->mnbgh", xq.view(*xq.shape[:-1], 2, 2),
                        lane_groups(codes.float()).view(n, k // 32, 8, 2, 2))
    scales = weight.scales.float().repeat_interleave(max(group // 16, 1), dim=1).view(n, k // 32, 2)
    y = (dots * (amax / 32767)[:, None]).sum(-2)  # (M, N, K / 32, 2 halves)
    y = (y * scales).sum((-2, -1))
    if weight.mins is None:
        return y
    return y + x2.reshape(-1, k // group, group).sum(-1) @ weight.mins.float().t()


def int8_gemm_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """y (M, N) = x (M, K) @ dequantize(W).T for an int8 weight: fp32 math, output in x's dtype."""
    if weight.format != "int8":
        raise ValueError(f"int8_gemm_reference needs an int8 weight, got {weight.format!r}")
    return (x.float() @ weight.dequantize(torch.float32).t()).to(x.dtype)


def int8_activation_gemm_reference(x: torch.Tensor, weight: QuantizedTensor, terms: int = 1) -> torch.Tensor:
    """fp32 (M, N): what kernels.cpu_a8 computes for an int4 or int8 weight. Each unit of U =
    min(group, 32) values of a row of x becomes int8 codes round(x / d), d = absmax / 127 (round
    half to even); each unit's integer dot with the weight codes is scaled by d and its group's
    weight scale, and a weight's min term uses the exact group sums of x. With ``terms`` 2 the
    rounding residual x - d * codes is rounded on a grid of d / 16 (clamped to -8..8) and its
    dots added. A weight with SuperScales runs with their exact products (as the kernels read
    them)."""
    if weight.format not in ("int4", "int8"):
        raise ValueError(f"int8_activation_gemm_reference needs an int4 or int8 weight, got {weight.format!r}")
    n, k = weight.shape
    group = weight.group_size
    unit = min(group, 32)
    x2 = x.float().reshape(-1, k)
    codes = unpack_int4(weight.qweight) if weight.format == "int4" else weight.qweight
    weight_scales, weight_mins = _kernel_scales(weight)
    scales = weight_scales.double().repeat_interleave(group // unit, dim=1)  # (N, K / U)
    y = torch.zeros(x2.shape[0], n, dtype=torch.float64)
    xu = x2.view(-1, k // unit, unit)
    d = xu.abs().amax(dim=-1, keepdim=True) / 127
    xq = torch.where(d > 0, torch.round(xu / d), torch.zeros_like(xu))
    for term in range(terms):
        if term == 1:  # the residual, fp32 as the kernel forms it, on a sixteenth of the grid
            residual, d = xu - d * xq, d / 16
            xq = torch.where(d > 0, torch.round(residual / d), torch.zeros_like(xu)).clamp(-8, 8)
        # Integer dots per unit in float64: exact.
        dots = torch.einsum("mui,nui->mnu", xq.double(), codes.double().view(n, k // unit, unit))
        y = y + (dots * scales * d.double().squeeze(-1)[:, None, :]).sum(-1)
    if weight_mins is not None:
        y = y + x2.double().view(-1, k // group, group).sum(-1) @ weight_mins.double().t()
    return y.float()


def _kernel_scales(weight: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scales and mins kernels.cpu_a8 computes with: a K-quant's exact two-level products
    where the weight has them (prepare_a8 keeps the two levels), else the weight's own."""
    if weight.super_scales is not None and keeps_two_levels(weight):
        return weight.super_scales.products()
    return weight.scales, weight.mins


def bf16_gemm_reference(x: torch.Tensor, weight: QuantizedTensor) -> torch.Tensor:
    """fp32 (M, N): what kernels.cpu_a8 computes with bf16 activations (the AMX-BF16 kernel) for
    an int4 or int8 weight: x rounded to bf16, each weight scale * code (+ min) formed with one
    rounding to fp32 (the kernel's FMA; exact in float64 first) and then rounded to bf16, the
    products summed in float64 (the kernel's fp32 sums differ from it by their rounding only)."""
    if weight.format not in ("int4", "int8"):
        raise ValueError(f"bf16_gemm_reference needs an int4 or int8 weight, got {weight.format!r}")
    n, k = weight.shape
    group = weight.group_size
    codes = (unpack_int4(weight.qweight) if weight.format == "int4" else weight.qweight).double()
    scales, mins = _kernel_scales(weight)
    w = codes.view(n, k // group, group) * scales.float().double()[..., None]
    if mins is not None:
        w = w + mins.float().double()[..., None]
    w_bf16 = w.view(n, k).float().bfloat16().double()
    x_bf16 = x.float().reshape(-1, k).bfloat16().double()
    return (x_bf16 @ w_bf16.t()).float()
