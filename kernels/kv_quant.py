"""KV cache formats: quantize / dequantize pairs for one token's keys or values per KV head.

Formats (x is (..., D): tokens and KV heads lead, head_dim last):

- ``fp32`` / ``bf16`` / ``fp16``: plain; ``data`` has the dtype, no scales.
- ``int8``: symmetric per (token, KV head): ``x = q * scale``; ``data`` int8 (..., D),
  ``scale`` (...,).
- ``int4``: asymmetric per (token, KV head, group of 32 channels): ``x = q * scale + zero``
  with q in 0..15 packed two per byte along D (channel ``2j`` in the low nibble of byte ``j``,
  the same packing as quant.formats); ``data`` uint8 (..., D // 2), ``scale`` and ``zero``
  (..., D // 32). ``zero`` is the group minimum.

Scales and zeros are stored as fp16 (``SCALE_DTYPE``): at head_dim 128 fp32 metadata would cost
int4 a quarter of its bytes, and fp16 keeps 11 bits, far finer than the 4- or 8-bit step. They
are rounded to fp16 *before* q is computed so that dequantization uses exactly the scale the
codes were made with. Rounding is half away from zero (floor(x + 0.5)), the same rule the
Triton cache-write kernel uses. This module owns the formats; it holds no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.formats import pack_int4

KV_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4")
PLAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT4_GROUP = 32
SCALE_DTYPE = torch.float16
_MIN_SCALE = 1e-6  # keeps an all-zero token from dividing by zero; fp16 can hold it


@dataclass(frozen=True)
class QuantizedKV:
    """Keys or values in one KV format: new tokens (T, Hkv, ...) from quantize_kv, or one layer's
    storage in the pool (N, B, Hkv, ...); shapes as in the module docstring and kernels.kv_pool."""

    kv_dtype: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.data, self.scale, self.zero) if t is not None)


def check_kv_dtype(kv_dtype: str, head_dim: int) -> None:
    """Raise ValueError when ``kv_dtype`` is unknown or cannot store ``head_dim`` channels."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype == "int4" and head_dim % INT4_GROUP:
        raise ValueError(f"int4 KV needs head_dim a multiple of {INT4_GROUP}, got {head_dim}")


def kv_bytes_per_element(kv_dtype: str, head_dim: int) -> float:
    """Bytes per stored channel of one token and KV head, scales and zeros included."""
    check_kv_dtype(kv_dtype, head_dim)
    scale_bytes = torch.finfo(SCALE_DTYPE).bits // 8
    if kv_dtype in PLAIN_DTYPES:
        return torch.finfo(PLAIN_DTYPES[kv_dtype]).bits / 8
    if kv_dtype == "int8":
        return 1 + scale_bytes / head_dim
    return 0.5 + 2 * scale_bytes / INT4_GROUP


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero: the rule the Triton kernels use (not torch.round)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def kv_rotation(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal (D, D) matrix R that quantized K and V are stored multiplied by.

    Attention keeps its value under a shared rotation, (q R)(k R)^T = q k^T, and the
    attention output over rotated values is out R, so the model rotates q and k before the
    cache write and un-rotates the output (edgeinfer.models.llama). Rotating spreads the few
    large channels that RoPE'd keys carry over all channels, so a 4-bit group no longer spends
    its range on one outlier. R is the normalised Hadamard matrix when D is a power of two,
    else a fixed seeded random orthogonal matrix.
    """
    if head_dim & (head_dim - 1) == 0:
        r = torch.ones(1, 1, dtype=torch.float64)
        while r.shape[0] < head_dim:
            r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
        r = r / head_dim**0.5
    else:
        gaussian = torch.randn(head_dim, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        r, _ = torch.linalg.qr(gaussian)
    return r.float().to(device)


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> QuantizedKV:
    """(..., D) floating keys or values -> QuantizedKV in ``kv_dtype``."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_kv needs a floating tensor, got {x.dtype}")
    check_kv_dtype(kv_dtype, x.shape[-1])
    if kv_dtype in PLAIN_DTYPES:
        return QuantizedKV(kv_dtype, x.to(PLAIN_DTYPES[kv_dtype]))
    xf = x.float()
    if kv_dtype == "int8":
        scale = (xf.abs().amax(dim=-1) / 127).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)  # (...,)
        q = round_half_away(xf / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedKV(kv_dtype, q, scale)
    g = xf.unflatten(-1, (-1, INT4_GROUP))  # (..., D // 32, 32)
    zero = g.amin(dim=-1).to(SCALE_DTYPE)  # (..., D // 32)
    # Range from the fp16-rounded zero so the largest value still lands on code 15.
    span = g.amax(dim=-1) - zero.float()
    scale = (span / 15).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)
    q = round_half_away((g - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return QuantizedKV(kv_dtype, pack_int4(q.flatten(-2)), scale, zero)


def dequantize_kv(qkv: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QuantizedKV -> (..., D) tensor of ``dtype``; works on any leading shape (e.g. pool blocks)."""
    if qkv.kv_dtype in PLAIN_DTYPES:
        return qkv.data.to(dtype)
    # In-place fp32 arithmetic on one output buffer: this runs on every CPU decode step, and
    # the out-of-place version with uint8 unpacking measured ~8x slower.
    if qkv.kv_dtype == "int8":
        return qkv.data.to(torch.float32).mul_(qkv.scale.float().unsqueeze(-1)).to(dtype)
    if qkv.kv_dtype == "int4":
        packed = qkv.data  # (..., D // 2)
        x = torch.empty(*packed.shape, 2, dtype=torch.float32, device=packed.device)
        x[..., 0] = packed & 0x0F  # even channels
        x[..., 1] = packed >> 4  # odd channels
        x = x.view(*packed.shape[:-1], -1, INT4_GROUP)  # (..., D // 32, 32)
        x.mul_(qkv.scale.float().unsqueeze(-1)).add_(qkv.zero.float().unsqueeze(-1))
        return x.flatten(-2).to(dtype)
    raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {qkv.kv_dtype!r}")
