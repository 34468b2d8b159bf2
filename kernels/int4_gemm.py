"""W4A16 GEMM in Triton: ``y = x @ dequantize(W).T`` for int4 group-wise weights.

Owns the int4 kernel, the kernel-ready weight (``Int4Weight``, made once at load by
``prepare_int4``), the tile configs (``GemmConfig``) and the per-shape config cache that
kernels.int8_gemm shares. The plain-torch reference is kernels.reference.int4_gemm_reference.

Weight layout (quant.formats "int4"): ``qweight`` uint8 (N, K // 2), element 2j in the low nibble
of byte j and 2j + 1 in the high nibble, ``w = q * scale + min`` per group of K. It stays as is;
``prepare_int4`` only transposes scales and mins to (K // group, N) so the N scales of a tile are
one coalesced load.

The kernel's invariant: BLOCK_K divides the group size, so one K tile sits in one group and has
one scale and one min per output row. Then

    sum_k x[m, k] * (q[n, k] * s[n] + mn[n]) = s[n] * (x @ q.T)[m, n] + mn[n] * sum_k x[m, k]

so the dot runs on the raw codes 0..15 (exact in fp16 and bf16) with fp32 accumulation and the
scale and min are applied in fp32 once per tile: fewer instructions per weight byte than
dequantizing every element, and no rounding of dequantized weights to 16 bits. The even and odd
columns of x meet the low and high nibbles, so bytes are never interleaved in registers.

Two schedules of the one kernel body:
- thin (M <= 16, decode): BLOCK_M = 16 and split-K, so that even at batch 1 there are enough
  programs to keep every SM pulling weight bytes; partial sums are atomically added into an fp32
  buffer, then cast to the activation dtype.
- tiled (M > 16, prefill): large M and N tiles, no split, grouped tile order for L2 reuse.
On CUDA each (schedule, M bucket, N, K, group, dtype) is timed once over a few configs and the
winner cached; tune before CUDA-graph capture (during capture the heuristic config is used).
On the CPU (TRITON_INTERPRET=1, tests only) the heuristic config is used without timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from quant.formats import QuantizedTensor

THIN_M = 16  # the largest M the thin (split-K) schedule takes
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _int4_gemm_kernel(
    # pointers
    x_ptr, qweight_ptr, scales_ptr, mins_ptr, y_ptr,
    # sizes
    M, N, K,
    # strides (qweight is contiguous along K, scales and mins are contiguous along N)
    stride_xm, stride_xk, stride_qn, stride_sg, stride_ym, stride_yn,
    # meta
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr,
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
    offs_b = tl.arange(0, BLOCK_K // 2)  # byte j of a tile holds columns 2j and 2j + 1

    num_k_tiles = K // BLOCK_K
    tiles_per_split = tl.cdiv(num_k_tiles, SPLIT_K)
    tile_start = pid_k * tiles_per_split
    tile_end = min(tile_start + tiles_per_split, num_k_tiles)

    x_even_ptrs = x_ptr + rm[:, None] * stride_xm + (2 * offs_b)[None, :] * stride_xk  # (BM, BK/2)
    q_ptrs = qweight_ptr + rn[:, None] * stride_qn + offs_b[None, :]  # (BN, BK/2) bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(tile_start, tile_end):
        k0 = t * BLOCK_K
        x_even = tl.load(x_even_ptrs + k0 * stride_xk)
        x_odd = tl.load(x_even_ptrs + (k0 + 1) * stride_xk)
        packed = tl.load(q_ptrs + k0 // 2)
        q_low = packed & 0xF
        q_high = packed >> 4
        if DOT_FP32:
            # fp32 activations, and bf16 under the interpreter (its bf16 dot is wrong): exact
            # fp32 products of values that are exact in fp32.
            part = tl.dot(x_even.to(tl.float32), tl.trans(q_low.to(tl.float32)), input_precision="ieee")
            part = tl.dot(x_odd.to(tl.float32), tl.trans(q_high.to(tl.float32)), part, input_precision="ieee")
        else:
            part = tl.dot(x_even, tl.trans(q_low.to(x_even.dtype)))
            part = tl.dot(x_odd, tl.trans(q_high.to(x_odd.dtype)), part)
        g = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + g * stride_sg + rn).to(tl.float32)
        mn = tl.load(mins_ptr + g * stride_sg + rn).to(tl.float32)
        x_sum = tl.sum(x_even.to(tl.float32), axis=1) + tl.sum(x_odd.to(tl.float32), axis=1)
        acc += part * scale[None, :] + x_sum[:, None] * mn[None, :]

    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)  # y is a zeroed fp32 buffer


@dataclass(frozen=True)
class Int4Weight:
    """An int4 weight ready for ``int4_gemm``; build it once at load with ``prepare_int4``."""

    shape: tuple[int, int]  # (N, K), logical
    group_size: int
    qweight: torch.Tensor  # uint8 (N, K // 2), contiguous, packed as quant.formats packs it
    scales: torch.Tensor  # (K // group_size, N), contiguous: transposed so a tile's scales coalesce
    mins: torch.Tensor  # (K // group_size, N), contiguous, same dtype as scales

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.group_size % 32 or k % self.group_size:
            raise ValueError(
                f"int4 kernel needs a group size that is a multiple of 32 and divides K={k}, "
                f"got {self.group_size}"
            )
        num_groups = k // self.group_size
        if self.qweight.dtype != torch.uint8 or tuple(self.qweight.shape) != (n, k // 2):
            raise ValueError(
                f"int4 qweight must be uint8 {(n, k // 2)}, got {self.qweight.dtype} "
                f"{tuple(self.qweight.shape)}"
            )
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if tuple(t.shape) != (num_groups, n) or t.dtype not in _SCALE_DTYPES:
                raise ValueError(
                    f"int4 {name} must be (K // group, N) = {(num_groups, n)} in one of "
                    f"{_SCALE_DTYPES}, got {t.dtype} {tuple(t.shape)}"
                )
        if self.mins.dtype != self.scales.dtype:
            raise ValueError(f"int4 mins are {self.mins.dtype} but scales are {self.scales.dtype}")
        for name, t in (("qweight", self.qweight), ("scales", self.scales), ("mins", self.mins)):
            if not t.is_contiguous():
                raise ValueError(f"int4 {name} must be contiguous")
            if t.device != self.qweight.device:
                raise ValueError(f"int4 {name} is on {t.device} but qweight is on {self.qweight.device}")


def prepare_int4(weight: QuantizedTensor) -> Int4Weight:
    """Convert a quant.formats int4 QuantizedTensor into the kernel's layout; once, at load."""
    if weight.format != "int4":
        raise ValueError(f"prepare_int4 needs an int4 weight, got format {weight.format!r}")
    assert weight.mins is not None  # QuantizedTensor checks this for int4
    return Int4Weight(
        shape=tuple(weight.shape),
        group_size=weight.group_size,
        qweight=weight.qweight.contiguous(),
        scales=weight.scales.t().contiguous(),
        mins=weight.mins.t().contiguous(),
    )


# ---- tile configs and per-shape tuning (shared with kernels.int8_gemm) ---------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of a weight-only GEMM kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"split_k, num_warps and num_stages must be >= 1 in {self}")


_TUNED: dict[tuple, GemmConfig] = {}  # written only by choose_config


def check_activation(x: torch.Tensor, shape: tuple[int, int], weight_device: torch.device, what: str) -> None:
    """Raise ValueError unless x is a (M, K) activation the kernels can take for an (N, K) weight."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: x must be a 2-D (M, K) tensor (flatten batch dims first), got {got}")
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"{what}: x must be one of {_ACTIVATION_DTYPES}, got {x.dtype}")
    if x.shape[1] != shape[1]:
        raise ValueError(f"{what}: x has K={x.shape[1]} but the weight is (N, K)={shape}")
    if x.device != weight_device:
        raise ValueError(f"{what}: x is on {x.device} but the weight is on {weight_device}")
    if x.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise ValueError(f"{what}: Triton needs CUDA tensors (CPU tensors only with TRITON_INTERPRET=1)")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}: unsupported device {x.device}")


def largest_block_k(group_size: int, smallest: int) -> int:
    """The largest BLOCK_K in 128..smallest that divides the group (one group per K tile)."""
    for block_k in (128, 64, 32, 16):
        if block_k >= smallest and group_size % block_k == 0:
            return block_k
    raise ValueError(f"group size {group_size} is not a multiple of {smallest}")


def candidate_configs(m: int, n: int, k: int, block_k: int, num_sms: int) -> list[GemmConfig]:
    """A small config space; the first entry is the heuristic pick used without timing."""
    if m <= THIN_M:
        configs = []
        num_k_tiles = k // block_k
        for block_n in (32, 64, 16, 128):
            num_n_tiles = triton.cdiv(n, block_n)
            # Enough programs for about two per SM, so every SM streams weights at batch 1.
            split_k = max(1, min(num_k_tiles, 16, triton.cdiv(2 * num_sms, num_n_tiles)))
            configs.append(GemmConfig(16, block_n, block_k, split_k, num_warps=4, num_stages=4))
            if split_k > 1:
                configs.append(GemmConfig(16, block_n, block_k, 1, num_warps=4, num_stages=4))
        return configs
    block_k = min(block_k, 64)
    small = [GemmConfig(32, 64, block_k, num_warps=4, num_stages=4)] if m <= 64 else []
    return small + [
        GemmConfig(64, 64, block_k, num_warps=4, num_stages=4),
        GemmConfig(64, 128, block_k, num_warps=4, num_stages=4),
        GemmConfig(128, 64, block_k, num_warps=4, num_stages=4),
        GemmConfig(128, 128, block_k, num_warps=8, num_stages=3),
    ]


def m_bucket(m: int) -> int:
    """Tuning key for M: the next power of two, capped at 4096."""
    return min(triton.next_power_of_2(max(m, 1)), 4096)


def choose_config(
    key: tuple, x: torch.Tensor, candidates: list[GemmConfig], run: Callable[[GemmConfig], object]
) -> GemmConfig:
    """On CUDA time each candidate once per key and cache the fastest; else the heuristic pick."""
    if x.device.type != "cuda":
        return candidates[0]
    cached = _TUNED.get(key)
    if cached is not None:
        return cached
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]  # cannot time inside a CUDA graph capture; tune during warm-up
    times = [triton.testing.do_bench(lambda c=c: run(c), warmup=5, rep=20) for c in candidates]
    best = candidates[min(range(len(candidates)), key=times.__getitem__)]
    _TUNED[key] = best
    return best


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs per output tile, so tests exercise split-K


def check_config(config: GemmConfig, group_size: int, smallest_block_k: int, what: str) -> None:
    if config.block_k < smallest_block_k or group_size % config.block_k:
        raise ValueError(
            f"{what}: block_k={config.block_k} must be >= {smallest_block_k} and divide the group "
            f"size {group_size}"
        )


# ---- public entry point ---------------------------------------------------------------------------


def launch(kernel: Callable, x: torch.Tensor, n: int, weight_args: tuple[torch.Tensor, ...],
           weight_strides: tuple[int, int], group_size: int, config: GemmConfig, **meta: bool) -> torch.Tensor:
    """Run a weight-only GEMM kernel of the shared signature (x, *weight tensors, y, sizes,
    strides, meta-parameters, then the kernel's own ``meta``) with ``config``; split-K partial
    sums accumulate in fp32."""
    m, k = x.shape
    split_k = min(config.split_k, k // config.block_k)
    if split_k > 1:
        y = torch.zeros((m, n), device=x.device, dtype=torch.float32)
    else:
        y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split_k)
    kernel[grid](
        x, *weight_args, y,
        m, n, k,
        x.stride(0), x.stride(1), *weight_strides,
        y.stride(0), y.stride(1),
        GROUP_SIZE=group_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SPLIT_K=split_k, GROUP_M=8,
        DOT_FP32=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type == "cpu"),
        num_warps=config.num_warps, num_stages=config.num_stages, **meta,
    )  # fmt: skip
    return y.to(x.dtype)


class PreparedWeight(Protocol):
    """What weight_only_gemm reads of an Int4Weight or Int8Weight."""

    shape: tuple[int, int]
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor


def weight_only_gemm(what: str, x: torch.Tensor, weight: PreparedWeight, smallest_block_k: int,
                     run: Callable[[GemmConfig], torch.Tensor], config: GemmConfig | None) -> torch.Tensor:
    """The checks and launch-configuration choice int4_gemm and int8_gemm share; ``run(config)``
    launches the kernel."""
    check_activation(x, weight.shape, weight.qweight.device, what)
    m, k = x.shape
    n = weight.shape[0]
    if m == 0:
        return x.new_empty((0, n))
    if config is None:
        block_k = largest_block_k(weight.group_size, smallest_block_k)
        candidates = candidate_configs(m, n, k, block_k, num_sms(x.device))
        key = (what, m_bucket(m), n, k, weight.group_size, x.dtype, weight.scales.dtype, x.device)
        config = choose_config(key, x, candidates, run)
    else:
        check_config(config, weight.group_size, smallest_block_k, what)
    return run(config)


def int4_gemm(x: torch.Tensor, weight: Int4Weight, *, config: GemmConfig | None = None) -> torch.Tensor:
    """y (M, N) = x (M, K) @ W.T for an int4 weight from ``prepare_int4``; y has x's dtype.

    ``config`` forces a launch configuration (tests, benchmarks); by default one is chosen per
    shape (timed once on CUDA).
    """
    if not isinstance(weight, Int4Weight):
        raise ValueError(f"int4_gemm needs an Int4Weight from prepare_int4, got {type(weight).__name__}")
    args = (weight.qweight, weight.scales, weight.mins)
    strides = (weight.qweight.stride(0), weight.scales.stride(0))
    return weight_only_gemm("int4_gemm", x, weight, 32, lambda c: launch(
        _int4_gemm_kernel, x, weight.shape[0], args, strides, weight.group_size, c), config)
