"""int4 / int8 weight x int8 activation CPU GEMMs (kernels/cpu/a8_gemm*.cpp): weight tiles, the
instruction-set choice and the call.

Activations are quantized inside the op, symmetric with a scale per 32 values (absmax / 127;
16 for int8 groups of 16: llama.cpp's Q8_1 granularity; on the default model one scale per row
cost 22% perplexity, per 32 +0.52%, per 16 +0.90%); the
integer dot products run on AMX (tdpbsud / tdpbssd, from 16 rows; AVX512-VNNI below),
AVX512-VNNI (vpdpbusd), AVX-VNNI or AVX2 (vpmaddubsw) kernels,
each compiled for its own instruction set, the best this CPU runs chosen once (``default_isa``;
``EDGEINFER_CPU_ISA`` names another for comparison and tests). A weight is re-laid out once
(``prepare_a8``) into tiles of 16 columns whose bytes hold 4 consecutive K values per column,
so one vector load feeds 16 output columns for every activation row of the batch.
kernels.reference.int8_activation_gemm_reference is the torch reference; the int16-activation
kernels of kernels.cpu_ops stay the accuracy reference against which this path is judged.

On AMX-BF16 CPUs the same tiles also run with bf16 activations (``A8Weight.bf16``,
RuntimeConfig.cpu_activations "bf16"; kernels/cpu/a8_gemm_amx_bf16.cpp): each 16-column tile
dequantized to bf16 once per call, products summed in fp32 over all of K in the tile unit, no
per-unit rescale; kernels.reference.bf16_gemm_reference is its torch reference.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quant.formats import QuantizedTensor, unpack_int4

ISA_ENV = "EDGEINFER_CPU_ISA"
ISAS = ("amx", "avx512vnni", "avxvnni", "avx2")  # best first
BF16_ISA = "amx_bf16"  # the bf16-activation kernel (A8Weight.bf16), not an int8 choice
COLS = 16  # output columns per weight tile (a8_gemm.h kA8Cols)
UNIT = 32  # activation values per scale, at most (a8_gemm.h kA8Unit; int8 groups of 16: 16)
SUPER_BLOCK = 256  # two-level scales: values of K per super-scale (a8_gemm.h kA8SuperBlock)


@dataclass(frozen=True)
class A8Weight:
    """A weight in the a8 kernels' tiles (see kernels/cpu/a8_gemm.h for the byte order)."""

    codes: torch.Tensor  # int4: uint8 (tiles, K // 32, 4, 64); int8: int8 (tiles, K // 4, 64)
    # fp16 or fp32 as the checkpoint's (bf16: fp32) (tiles, groups, 16); or, for a K-quant's
    # SuperScales, uint8 (tiles, K // 256, 160): per super-block 16 fp16 super-scales, 8 x 16 codes
    scales: torch.Tensor
    mins: torch.Tensor | None  # like the scales; int4 always
    wsum: torch.Tensor | None  # int8: int16 (tiles, K // min(group, 32), 16), the unit's code sum
    shape: tuple[int, int]  # (N, K)
    group_size: int
    int4: bool
    terms: int = 1  # activations as 1 int8 term, or 2 (x and its rounding residual on d / 16: int16-like accuracy)
    bf16: bool = False  # activations and weights rounded to bf16 on AMX-BF16 instead (terms 1)

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.codes, self.scales, self.mins, self.wsum) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def supports(weight: QuantizedTensor) -> bool:
    """int4 with K and group multiples of 32, or int8 with K a multiple of 32 and groups of 16k."""
    k, group = weight.shape[1], weight.group_size
    if k % 32:
        return False
    return (weight.format == "int4" and group % 32 == 0) or (weight.format == "int8" and group % 16 == 0)


def keeps_two_levels(weight: QuantizedTensor) -> bool:
    """Whether prepare_a8 lays the weight's SuperScales into its tiles (int4 g32, super-blocks of
    256 dividing K: GGUF Q4_K), so that the kernels compute with their exact products."""
    levels = weight.super_scales
    return weight.format == "int4" and weight.group_size == 32 and levels is not None and \
        levels.block == SUPER_BLOCK and weight.shape[1] % SUPER_BLOCK == 0


def prepare_a8(weight: QuantizedTensor, terms: int = 1, bf16: bool = False) -> A8Weight:
    """Re-lay a quant.formats int4 or int8 weight into 16-column tiles (N padded with zeros), to
    be run with activations in ``terms`` int8 terms, or with ``bf16`` in bf16 (a8_linear)."""
    if terms not in (1, 2) or (bf16 and terms != 1):
        raise ValueError(f"terms must be 1 or 2 (1 with bf16), got {terms}")
    if not supports(weight):
        raise ValueError(f"the int8-activation kernels need int4 (K, group multiples of 32) or int8 (K a multiple of "
                         f"32, group of 16) weights, got {weight.format} {weight.shape} group {weight.group_size}")
    n, k = weight.shape
    group = weight.group_size
    tiles = -(-n // COLS)
    pad = tiles * COLS - n
    int4 = weight.format == "int4"
    q = unpack_int4(weight.qweight) if int4 else weight.qweight  # (N, K)
    q = F.pad(q, (0, 0, 0, pad)).view(tiles, COLS, k)
    if int4:
        # k = 32b + 16 * half + 4v + j -> byte [tile, b, v, 4c + j], half 0 low nibble, 1 high.
        q = q.view(tiles, COLS, k // 32, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        codes = (q[..., 0] | (q[..., 1] << 4)).contiguous().view(tiles, k // 32, 4, 64)
    else:
        codes = q.view(tiles, COLS, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(tiles, k // 4, 64)

    # Scales and mins stay fp16 where the checkpoint has them so (a GGUF's are): a decode step of a
    # model larger than the caches reads every byte, and fp32 ones made a Q4_K tile 24 instead of
    # 20 bytes per 32 weights. Others (fp32, bf16) run as fp32, exactly.
    params = [t for t in (weight.scales, weight.mins) if t is not None]
    dtype = torch.float16 if all(t.dtype == torch.float16 for t in params) else torch.float32

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # (N, groups) -> (tiles, groups, 16)
        return F.pad(t.to(dtype), (0, 0, 0, pad)).view(tiles, COLS, k // group).transpose(1, 2).contiguous()

    levels = weight.super_scales
    if levels is not None and keeps_two_levels(weight):
        # A K-quant's two levels as its file has them (a8_gemm.h): per tile and super-block the 16
        # columns' fp16 super-scale, then per group their codes; 18.5 bytes per 32 weights, not 20.
        def two_level(d: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
            blocks = k // SUPER_BLOCK
            d = F.pad(d.half(), (0, 0, 0, pad)).view(tiles, COLS, blocks).transpose(1, 2).contiguous()
            codes = F.pad(codes, (0, 0, 0, pad)).view(tiles, COLS, blocks, SUPER_BLOCK // 32).permute(0, 2, 3, 1)
            return torch.cat((d.view(torch.uint8), codes.reshape(tiles, blocks, -1)), dim=-1).contiguous()

        return A8Weight(codes, two_level(levels.d, levels.scale_codes), two_level(levels.neg_dmin, levels.min_codes),
                        None, (n, k), group, int4, terms, bf16)
    mins = per_tile(weight.mins) if weight.mins is not None else None
    wsum = None
    if not int4:
        unit = min(group, UNIT)
        sums = weight.qweight.view(n, k // unit, unit).sum(-1, dtype=torch.int32)  # |sum| <= 32 * 128: int16
        wsum = F.pad(sums, (0, 0, 0, pad)).view(tiles, COLS, k // unit).transpose(1, 2).to(torch.int16).contiguous()
    return A8Weight(codes, per_tile(weight.scales), mins, wsum, (n, k), group, int4, terms, bf16)


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs the ``isa`` kernel; the C++ ops must be loaded (kernels.cpu_ops.available(),
    which imports this module for its weight type, so it is not called from here)."""
    if isa not in (*ISAS, BF16_ISA):
        raise ValueError(f"{ISA_ENV} must be one of {ISAS}, got {isa!r}")
    if not hasattr(torch.ops.edgeinfer_cpu, "a8_isa_supported"):
        raise RuntimeError("the C++ CPU ops are not loaded: call kernels.cpu_ops.available() first")
    return torch.ops.edgeinfer_cpu.a8_isa_supported(isa)


def run_isa(isa: str, rows: int, terms: int) -> str:
    """The kernel the op runs when asked for ``isa`` on ``rows`` rows of x with ``terms`` terms:
    "amx" runs the AVX512-VNNI kernel below its smallest worthwhile block (kernels/cpu/ops.h
    kA8AmxMinRows); every other ISA runs as asked. The C++ ops must be loaded."""
    if not hasattr(torch.ops.edgeinfer_cpu, "a8_run_isa"):
        raise RuntimeError("the C++ CPU ops are not loaded: call kernels.cpu_ops.available() first")
    return torch.ops.edgeinfer_cpu.a8_run_isa(isa, rows, terms)


@functools.cache
def default_isa() -> str:
    """The kernel to run, decided once: ``EDGEINFER_CPU_ISA`` where set, else the best one this CPU runs."""
    requested = os.environ.get(ISA_ENV, "").lower()
    if requested:
        if not isa_supported(requested):
            raise ValueError(f"{ISA_ENV}={requested}: this CPU cannot run that kernel")
        return requested
    return next((isa for isa in ISAS if isa_supported(isa)), "avx2")


def a8_linear(x: torch.Tensor, weight: A8Weight, isa: str | None = None, bf16: bool | None = None) -> torch.Tensor:
    """fp32 (M, N) = x (M, K), any float dtype, @ W.T with x rounded to int8 (a scale per 32; with
    ``weight.terms`` 2, x's codes plus its rounding residual's on a sixteenth of their grid, summed
    in int32 as 16 x the codes' dot + the residual's) on
    ``isa`` (default: ``default_isa()``); with ``bf16`` (default: ``weight.bf16``) x runs in bf16
    on AMX-BF16 instead."""
    n, k = weight.shape
    bf16 = weight.bf16 if bf16 is None else bf16
    return torch.ops.edgeinfer_cpu.a8_gemm(x, weight.codes, weight.scales, weight.mins, weight.wsum, n, k,
                                           weight.group_size, weight.int4, BF16_ISA if bf16 else isa or default_isa(),
                                           1 if bf16 else weight.terms)
