"""Round-to-nearest int4/int8 groups whose scales (and mins) are fp16 values, for GGUF export.

GGUF's Q4_1 block stores ``d`` and ``m`` as fp16 and Q8_0 its ``d``; quant.formats' quantizers
keep fp32 scales. Rounding those to fp16 after the codes were chosen would change every weight
of a group by up to 15 half-ulps of its scale; here the scale and min are rounded first and the
codes chosen against the rounded values, so the exported file holds exactly the weights the
engine quantized (and runs). The tensors store the scales as fp16, which every kernel reads
(GGUF imports have them).
"""

from __future__ import annotations

import torch

from quant.formats import QuantizedTensor, pack_int4

FP16_TINY = 2.0**-24  # the smallest positive fp16 (subnormal): a constant group's scale


def int4_params_fp16(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, min) of groups w (..., g): min rounded first, the scale spans [min, max]."""
    lo = w.amin(dim=-1).half()
    scale = ((w.amax(dim=-1) - lo.float()) / 15).clamp(min=FP16_TINY).half()
    return scale, lo


def int8_scale_fp16(w: torch.Tensor) -> torch.Tensor:
    """fp16 symmetric scale of groups w (..., g)."""
    return (w.abs().amax(dim=-1) / 127).clamp(min=FP16_TINY).half()


def quantize_int4_fp16(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Asymmetric int4 (as quant.formats.quantize_int4) with fp16 scales and mins."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    scale, lo = int4_params_fp16(g)
    q = torch.round((g - lo.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).reshape(n, k)
    return QuantizedTensor("int4", (n, k), group_size, pack_int4(q), scale, lo)


def quantize_int8_fp16(w: torch.Tensor, group_size: int | None = None) -> QuantizedTensor:
    """Symmetric int8 (as quant.formats.quantize_int8) with fp16 scales."""
    n, k = w.shape
    group_size = group_size or k
    g = w.float().reshape(n, k // group_size, group_size)
    scale = int8_scale_fp16(g)
    q = torch.round(g / scale.float()[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedTensor("int8", (n, k), group_size, q, scale)
