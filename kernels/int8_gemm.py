"""W8A16 GEMM in Triton: ``y = x @ dequantize(W).T`` for int8 group-wise weights, with mins or not.

Owns the int8 kernel, the kernel-ready weight (``Int8Weight``, made once at load by
``prepare_int8``) and its public wrapper. Tile configs, schedules and the per-shape tuning cache
are shared with kernels.int4_gemm (see its docstring); the reference is
kernels.reference.int8_gemm_reference.

Weight layout (quant.formats "int8"): ``qweight`` int8 (N, K), ``w = q * scale (+ min)`` per group
of K (per output channel is group = K; GGUF Q6_K brings groups of 16, Q5_1/Q5_K mins).
``prepare_int8`` keeps qweight and transposes the scales (and mins) to (K // group, N) so the N
scales of a tile are one coalesced load.

As in the int4 kernel, BLOCK_K divides the group, so each K tile has one scale per output row and
``sum_k x[m, k] * q[n, k] * s[n] = s[n] * (x @ q.T)[m, n]``: the dot runs on the raw codes
-127..127 (exact in fp16 and bf16) with fp32 accumulation, and the scale is applied in fp32 once
per tile; a min adds ``min[n] * sum_k x[m, k]`` over the tile, as in the int4 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.int4_gemm import GemmConfig, launch, weight_only_gemm
from quant.formats import QuantizedTensor

_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _int8_gemm_kernel(
    # pointers
    x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr,
    # sizes
    M, N, K,
    # strides (qweight is contiguous along K, scales are contiguous along N)
    stride_xm, stride_xk, stride_qn, stride_sg, stride_ym, stride_yn,
    # meta
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, HAS_MINS: tl.constexpr,
):  # fmt: skip
    """One (BLOCK_M, BLOCK_N) tile of y over one split of K; fp32 accumulation throughout."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped tile order: GROUP_M row tiles share each weight column tile while it is in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_m
    pid_n = (pid % num_pid_in_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrap rather than mask: rows past M or N re-read valid rows, so the loop's loads need no
    # masks (they vectorise); only the final store is masked.
    rm = offs_m % M
    rn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)

    num_k_tiles = K // BLOCK_K
    tiles_per_split = tl.cdiv(num_k_tiles, SPLIT_K)
    tile_start = pid_k * tiles_per_split
    tile_end = min(tile_start + tiles_per_split, num_k_tiles)

    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BM, BK)
    q_ptrs = qweight_ptr + rn[:, None] * stride_qn + offs_k[None, :]  # (BN, BK) int8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(tile_start, tile_end):
        k0 = t * BLOCK_K
        x = tl.load(x_ptrs + k0 * stride_xk)
        q = tl.load(q_ptrs + k0)
        if DOT_FP32:
            # fp32 activations, and bf16 under the interpreter (its bf16 dot is wrong): exact
            # fp32 products of values that are exact in fp32.
            part = tl.dot(x.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(q.to(x.dtype)))
        scale = tl.load(scales_ptr + (k0 // GROUP_SIZE) * stride_sg + rn).to(tl.float32)
        acc += part * scale[None, :]
        if HAS_MINS:
            mn = tl.load(mins_ptr + (k0 // GROUP_SIZE) * stride_sg + rn).to(tl.float32)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * mn[None, :]

    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)  # y is a zeroed fp32 buffer


@dataclass(frozen=True)
class Int8Weight:
    """An int8 weight ready for ``int8_gemm``; build it once at load with ``prepare_int8``."""

    shape: tuple[int, int]  # (N, K)
    group_size: int
    qweight: torch.Tensor  # int8 (N, K), contiguous
    scales: torch.Tensor  # (K // group_size, N), contiguous: transposed so a tile's scales coalesce
    mins: torch.Tensor | None = None  # as scales, same dtype; None: w = q * scale

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.group_size % 16 or k % self.group_size:
            raise ValueError(
                f"int8 kernel needs a group size that is a multiple of 16 and divides K={k}, "
                f"got {self.group_size}"
            )
        if self.qweight.dtype != torch.int8 or tuple(self.qweight.shape) != (n, k):
            raise ValueError(
                f"int8 qweight must be int8 {(n, k)}, got {self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        num_groups = k // self.group_size
        if tuple(self.scales.shape) != (num_groups, n) or self.scales.dtype not in _SCALE_DTYPES:
            raise ValueError(
                f"int8 scales must be (K // group, N) = {(num_groups, n)} in one of {_SCALE_DTYPES}, "
                f"got {self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.mins is not None and (self.mins.shape != self.scales.shape or self.mins.dtype != self.scales.dtype
                                      or self.mins.device != self.scales.device):
            raise ValueError(f"int8 mins must match the scales' shape, dtype and device, got {self.mins.dtype} "
                             f"{tuple(self.mins.shape)}")
        for name, t in (("qweight", self.qweight), ("scales", self.scales), ("mins", self.mins)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"int8 {name} must be contiguous")
        if self.scales.device != self.qweight.device:
            raise ValueError(
                f"int8 scales are on {self.scales.device} but qweight is on {self.qweight.device}"
            )


def prepare_int8(weight: QuantizedTensor) -> Int8Weight:
    """Convert a quant.formats int8 QuantizedTensor into the kernel's layout; once, at load."""
    if weight.format != "int8":
        raise ValueError(f"prepare_int8 needs an int8 weight, got format {weight.format!r}")
    return Int8Weight(
        shape=tuple(weight.shape),
        group_size=weight.group_size,
        qweight=weight.qweight.contiguous(),
        scales=weight.scales.t().contiguous(),
        mins=None if weight.mins is None else weight.mins.to(weight.scales.dtype).t().contiguous(),
    )


def int8_gemm(x: torch.Tensor, weight: Int8Weight, *, config: GemmConfig | None = None) -> torch.Tensor:
    """y (M, N) = x (M, K) @ W.T for an int8 weight from ``prepare_int8``; y has x's dtype.

    ``config`` forces a launch configuration (tests, benchmarks); by default one is chosen per
    shape (timed once on CUDA).
    """
    if not isinstance(weight, Int8Weight):
        raise ValueError(f"int8_gemm needs an Int8Weight from prepare_int8, got {type(weight).__name__}")
    # Without mins the kernel never reads its mins pointer; the scales stand in for it.
    args = (weight.qweight, weight.scales, weight.scales if weight.mins is None else weight.mins)
    strides = (weight.qweight.stride(0), weight.scales.stride(0))
    return weight_only_gemm("int8_gemm", x, weight, 16, lambda c: launch(
        _int8_gemm_kernel, x, weight.shape[0], args, strides, weight.group_size, c,
        HAS_MINS=weight.mins is not None), config)
