"""GGUF quantized blocks -> QuantizedTensor, without a detour through fp32.

Each decoder takes a 2-D tensor's raw bytes (N rows of K // block elements' blocks) and returns
the engine format whose kernels run it:

| GGUF | engine | exactness |
|---|---|---|
| Q4_0, Q4_1 | int4 g32 (Q4_0: min = -8 d, fp32) | bit-exact |
| Q8_0 | int8 g32 | bit-exact |
| Q5_0 | int8 g32, codes q - 16 | bit-exact |
| Q5_1 | int8 g32 with mins | bit-exact |
| Q4_K | int4 g32, scale d*sc, min -dmin*m | products rounded to fp16; the two levels kept too (SuperScales) |
| Q5_K | int8 g32 with mins, the same products | products rounded to fp16 |
| Q6_K | int8 g16, codes q - 32, scale d*sc | product rounded to fp16 |

K-quant products are computed in fp32 (exact: an fp16 times a 6- or 8-bit integer) and stored
fp16, so a weight's error is at most 2^-11 * (|code * scale| + |min|) (fp16 normals), which is
what tests check against gguf.quants.dequantize. fp16 products cost 20 bytes per 32 Q4_K
weights against the file's 18 (1.11x); fp32 ones would cost 24. Q4_K's two levels (d, dmin and
the 6-bit codes) also ride along as the weight's SuperScales, which the int8-activation CPU
kernels read as they are (18.5 bytes per 32, exact); other paths use the products.

Layouts follow ggml-quants.c (dequantize_row_*); element order along K is the file's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from quant.formats import QuantizedTensor, SuperScales, quantize_int4
from quant.gguf_reader import GGMLType, TensorInfo

Q_BLOCK = 32  # elements per Q4_0/Q4_1/Q5_x/Q8_0 block, and per K-quant sub-block (Q6_K: 16)
K_BLOCK = 256  # elements per K-quant super-block


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of every block, as float16 (..., )."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: byte j holds element j (low) and j + 16 (high)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of fifth bits (little-endian uint32, bit j: element j) -> (..., 32) 0/16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # (..., 32), bit j of the uint32 at j
    return bits << 4


def _pack_int4(codes: np.ndarray, n: int, k: int) -> torch.Tensor:
    """(n, k) codes 0..15 -> quant.formats' int4 bytes (element 2j low, 2j + 1 high). In numpy:
    torch's uint8 ops here would bring ~2 MB of their kernels' code pages in for the load alone."""
    codes = codes.reshape(n, k)
    return torch.from_numpy(np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)))


def _int8(codes: np.ndarray, n: int, k: int, group: int, scales: np.ndarray,
          mins: np.ndarray | None = None) -> QuantizedTensor:
    q = torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k).astype(np.int8)))
    to_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a.reshape(n, k // group)))  # noqa: E731
    return QuantizedTensor("int8", (n, k), group, q, to_torch(scales), None if mins is None else to_torch(mins))


def q4_blocks(raw: np.ndarray, n: int, k: int, has_min: bool) -> QuantizedTensor:
    """Q4_0 / Q4_1 -> int4 g32. Block: d (fp16) [, m (fp16)], 16 bytes of nibbles."""
    blocks = raw.reshape(n, k // Q_BLOCK, 20 if has_min else 18)
    d = _f16(blocks, 0)
    elements = _nibbles(blocks[..., 4:] if has_min else blocks[..., 2:])  # (n, k // 32, 32) in order
    packed = _pack_int4(elements, n, k)
    scales = torch.from_numpy(d.copy())
    # Q4_0's -8 * d in fp16 can round; keep it exact in fp32 instead.
    mins = torch.from_numpy(_f16(blocks, 2).copy()) if has_min else -8.0 * scales.float()
    return QuantizedTensor("int4", (n, k), Q_BLOCK, packed, scales, mins)


def q8_blocks(raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    """Q8_0 -> int8 g32. Block: d (fp16), 32 int8 codes."""
    blocks = raw.reshape(n, k // Q_BLOCK, 34)
    return _int8(blocks[..., 2:].copy().view(np.int8), n, k, Q_BLOCK, _f16(blocks, 0))


def q5_blocks(raw: np.ndarray, n: int, k: int, has_min: bool) -> QuantizedTensor:
    """Q5_0 / Q5_1 -> int8 g32. Block: d (fp16) [, m (fp16)], 4 bytes of fifth bits, 16 bytes of
    nibbles; Q5_0 is w = d * (q - 16), so its codes are q - 16 and it needs no min."""
    blocks = raw.reshape(n, k // Q_BLOCK, 24 if has_min else 22)
    at = 4 if has_min else 2
    q = (_nibbles(blocks[..., at + 4:]) | _high_bits(blocks[..., at:at + 4])).astype(np.int16)
    if has_min:
        return _int8(q, n, k, Q_BLOCK, _f16(blocks, 0), _f16(blocks, 2))
    return _int8(q - 16, n, k, Q_BLOCK, _f16(blocks, 0))


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins (get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.concatenate((s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)), axis=-1)
    mn = np.concatenate((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), axis=-1)
    return sc, mn


def _k_products(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp16 scale d * sc and min -dmin * m per sub-block, each product exact in fp32 first."""
    scale = (d.astype(np.float32)[..., None] * sc).astype(np.float16)
    mins = (-dmin.astype(np.float32)[..., None] * mn).astype(np.float16)
    return scale, mins


def _k_low_codes(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> (..., 8, 32) 4-bit codes: bytes 32j..32j+31 hold sub-block 2j in
    their low nibbles and 2j + 1 in their high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack((chunks & 0x0F, chunks >> 4), axis=-2).reshape(*qs.shape[:-1], 8, 32)


def q4_k_blocks(raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    """Q4_K -> int4 g32. Super-block: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes
    of nibbles; w = d * sc * q - dmin * m per sub-block of 32."""
    blocks = raw.reshape(n, k // K_BLOCK, 144)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales_mins(blocks[..., 4:16])
    scale, mins = _k_products(d, dmin, sc, mn)
    codes = _k_low_codes(blocks[..., 16:]).reshape(n, k)
    levels = SuperScales(torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(sc.reshape(n, k // Q_BLOCK)),
                         torch.from_numpy(np.ascontiguousarray(-dmin)), torch.from_numpy(mn.reshape(n, k // Q_BLOCK)),
                         K_BLOCK)
    return QuantizedTensor("int4", (n, k), Q_BLOCK, _pack_int4(codes, n, k),
                           torch.from_numpy(scale.reshape(n, k // Q_BLOCK)),
                           torch.from_numpy(mins.reshape(n, k // Q_BLOCK)), levels)


def q5_k_blocks(raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    """Q5_K -> int8 g32 with mins. Super-block: d, dmin, 12 bytes of scales and mins, 32 bytes of
    fifth bits (bit j of byte l: sub-block j's element l), 128 bytes of nibbles as Q4_K."""
    blocks = raw.reshape(n, k // K_BLOCK, 176)
    scale, mins = _k_products(_f16(blocks, 0), _f16(blocks, 2), *_k_scales_mins(blocks[..., 4:16]))
    qh = blocks[..., 16:48]  # (n, s, 32)
    high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4  # (n, s, 8, 32)
    codes = _k_low_codes(blocks[..., 48:]) | high
    return _int8(codes, n, k, Q_BLOCK, scale, mins)


def q6_k_blocks(raw: np.ndarray, n: int, k: int) -> QuantizedTensor:
    """Q6_K -> int8 g16, codes q - 32 (w = d * sc * (q - 32), no min). Super-block: 128 bytes of
    low nibbles, 64 of 2-bit high parts, 16 int8 scales, d (fp16). Per half of 128 elements
    (ql 64 bytes, qh 32): element 32c + l takes ql[l + 32 * (c % 2)]'s nibble c // 2 and bits
    2c..2c+1 of qh[l]."""
    blocks = raw.reshape(n, k // K_BLOCK, 210)
    ql = blocks[..., 0:128].reshape(n, -1, 2, 2, 32)  # (n, s, half, c % 2, l)
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)  # (n, s, half, 1, l)
    low = np.stack((ql & 0x0F, ql >> 4), axis=-3)  # (n, s, half, c // 2, c % 2, l)
    low = low.reshape(*low.shape[:3], 4, 32)  # (n, s, half, c, l)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # (n, s, half, c, l)
    codes = (low | (high << 4)).astype(np.int16) - 32
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # (n, s, 16)
    scale = (_f16(blocks, 208).astype(np.float32)[..., None] * sc).astype(np.float16)
    return _int8(codes, n, k, 16, scale)


def requantize_int4(values: np.ndarray) -> tuple[QuantizedTensor, float]:
    """A dequantized (N, K) fp32 tensor of a type without a kernel (Q2_K, Q3_K, IQ*) -> int4 g32,
    and the RMS of the error this adds relative to the tensor's RMS (what the loader's warning
    reports)."""
    w = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    qt = quantize_int4(w, Q_BLOCK)
    qt = QuantizedTensor("int4", qt.shape, Q_BLOCK, qt.qweight, qt.scales.half(), qt.mins.half())
    error = (qt.dequantize() - w).square().mean().sqrt() / w.square().mean().sqrt().clamp(min=1e-30)
    return qt, float(error)


# GGUF type -> its decoder into an engine format; F32/F16/BF16 stay dense (quant.gguf_import).
DECODERS: dict[int, Callable[[np.ndarray, int, int], QuantizedTensor]] = {
    GGMLType.Q4_0: lambda raw, n, k: q4_blocks(raw, n, k, has_min=False),
    GGMLType.Q4_1: lambda raw, n, k: q4_blocks(raw, n, k, has_min=True),
    GGMLType.Q8_0: q8_blocks,
    GGMLType.Q5_0: lambda raw, n, k: q5_blocks(raw, n, k, has_min=False),
    GGMLType.Q5_1: lambda raw, n, k: q5_blocks(raw, n, k, has_min=True),
    GGMLType.Q4_K: q4_k_blocks,
    GGMLType.Q5_K: q5_k_blocks,
    GGMLType.Q6_K: q6_k_blocks,
}
_DENSE = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def requantized_types(tensors: Iterable[TensorInfo]) -> dict[int, list[TensorInfo]]:
    """The tensors quant.gguf_import.convert_tensor re-quantizes to int4 (2-D, K a multiple of
    32, a type without a decoder), by GGUF type."""
    found: dict[int, list[TensorInfo]] = {}
    for t in tensors:
        if len(t.shape) == 2 and t.shape[0] % Q_BLOCK == 0 and t.ggml_type not in (*_DENSE, *DECODERS):
            found.setdefault(t.ggml_type, []).append(t)
    return found


def dequantize_other(ggml_type: int, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 values (``shape``, rows first) of a type without a decoder, by the gguf package;
    NotImplementedError where that has none either."""
    from gguf import GGMLQuantizationType, dequantize

    try:
        kind = GGMLQuantizationType(ggml_type)
    except ValueError as exc:
        raise NotImplementedError(f"GGUF type {ggml_type} is unknown to the gguf package") from exc
    return dequantize(raw.reshape(shape[0], -1), kind).astype(np.float32).reshape(shape)


def type_name(ggml_type: int) -> str:
    """The GGUF type's name as the gguf package spells it."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"
