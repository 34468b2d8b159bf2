"""edgeinfer int4/int8 <-> compressed-tensors' integer codes, exactly, both ways.

edgeinfer int4 is ``w = s * u + m`` (u in 0..15); compressed-tensors' asymmetric int4 is
``w = s * (q - z)`` with q and an integer zero point z in -8..7 (stored biased by 8 when packed,
``pack_to_int32``). The two are the same number exactly when ``m = -s * (z + 8)``, i.e. ``-m / s``
is an integer in 0..15, and then ``q = u - 8``. The converter's own quantizer picks a real-valued
min, so for this target ``quantize_int4_zp`` rounds the zero point to an integer first (as
compressed-tensors' own ``calculate_qparams`` does: the range always holds 0) and chooses the
codes against it; its scales are fp16 values, so a folder loaded in fp16 (vLLM) holds the same
numbers too. int8 symmetric is ``w = s * q`` on both sides (q in -127..127 here, -128..127
there).

``to_codes`` says why a weight cannot be written (a real-valued min, nf4); ``from_codes`` maps
any pack-quantized int4/int8 (symmetric or not, per group or per channel) onto a QuantizedTensor
without loss (``m = -s * (z + 8)`` is exact in fp32: an fp16/bf16 scale times a 5-bit integer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.formats import QuantizedTensor, pack_int4, unpack_int4
from quant.fp16_groups import FP16_TINY


@dataclass(frozen=True)
class Codes:
    """One weight as compressed-tensors stores it (before packing)."""

    num_bits: int  # 4 | 8
    group_size: int  # == K: one group per row (strategy "channel")
    codes: torch.Tensor  # int8 (N, K), signed: int4 -8..7, int8 -128..127
    scale: torch.Tensor  # (N, K // group_size)
    zero_point: torch.Tensor | None  # int8 (N, K // group_size); None: symmetric

    @property
    def strategy(self) -> str:
        """int8 per row is "channel" (W8A16); int4 is "group" even where one group spans K, so a
        model has one scheme (transformers' dequantizing load applies the first one to all)."""
        return "channel" if self.num_bits == 8 and self.group_size == self.codes.shape[1] else "group"


class NotRepresentable(ValueError):
    """A weight that compressed-tensors' pack-quantized layout cannot hold exactly."""


def quantize_int4_zp(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Round-to-nearest asymmetric int4 with an integer zero point and fp16 scale values."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=FP16_TINY).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    u = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).reshape(n, k)
    return QuantizedTensor("int4", (n, k), group_size, pack_int4(u), scale, -scale * zero)


def _integer_zero(weight: QuantizedTensor, bias: int, lo: int, hi: int) -> torch.Tensor:
    """z with m == -s * (z + bias) exactly and lo <= z <= hi, or NotRepresentable."""
    assert weight.mins is not None
    s, m = weight.scales.float(), weight.mins.float()
    zero = torch.round(-m / s) - bias
    if not torch.equal(-s * (zero + bias), m) or zero.min() < lo or zero.max() > hi:
        raise NotRepresentable(
            f"{weight.format} mins that are not -scale x an integer zero point (compressed-tensors stores "
            "w = s * (q - z)); quantize with --format compressed-tensors, which rounds the zero point first")
    return zero.to(torch.int8)


def to_codes(weight: QuantizedTensor) -> Codes:
    """The compressed-tensors codes of an int4/int8 weight, exactly, or NotRepresentable."""
    if weight.format == "int4":
        zero = _integer_zero(weight, 8, -8, 7)
        codes = (unpack_int4(weight.qweight).to(torch.int16) - 8).to(torch.int8)
        return Codes(4, weight.group_size, codes, weight.scales, zero)
    if weight.format == "int8":
        zero = None if weight.mins is None else _integer_zero(weight, 0, -128, 127)
        return Codes(8, weight.group_size, weight.qweight, weight.scales, zero)
    raise NotRepresentable(f"{weight.format} has no compressed-tensors pack-quantized layout (integer codes "
                           "with a scale and zero point); quantize with --weights int4 or int8")


def from_codes(codes: Codes) -> QuantizedTensor:
    """A QuantizedTensor computing exactly ``scale * (codes - zero_point)``."""
    n, k = codes.codes.shape
    scale = codes.scale.float().reshape(n, k // codes.group_size)
    zero = (torch.zeros_like(scale) if codes.zero_point is None
            else codes.zero_point.float().reshape(scale.shape))
    if codes.num_bits == 4:
        u = (codes.codes.to(torch.int16) + 8).to(torch.uint8)
        return QuantizedTensor("int4", (n, k), codes.group_size, pack_int4(u), scale, -scale * (zero + 8))
    if codes.num_bits == 8:
        mins = None if codes.zero_point is None else -scale * zero
        return QuantizedTensor("int8", (n, k), codes.group_size, codes.codes.to(torch.int8), scale, mins)
    raise NotRepresentable(f"{codes.num_bits}-bit integer weights have no edgeinfer kernel (int4 and int8 do)")
