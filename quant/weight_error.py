"""How far a converted weight is from its source: the relative Frobenius error the conversion
report gives per weight, computed a slab of rows at a time so that checking an embedding never
holds two fp32 copies of it."""

from __future__ import annotations

import torch

from quant.formats import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor


def dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize(torch.float32) if isinstance(weight, QuantizedTensor) else weight.float()


def _row_slice(weight: Weight, start: int, stop: int) -> Weight:
    """Rows start:stop of a weight (elements, for a 1-D one)."""
    if not isinstance(weight, QuantizedTensor):
        return weight[start:stop]
    k, g = weight.shape[1], weight.group_size
    if weight.format == "nf4":  # flat layout; a block never spans two rows
        return QuantizedTensor("nf4", (stop - start, k), g, weight.qweight[start * k // 2:stop * k // 2],
                               weight.scales[start * k // g:stop * k // g])
    mins = None if weight.mins is None else weight.mins[start:stop]
    return QuantizedTensor(weight.format, (stop - start, k), g, weight.qweight[start:stop],
                           weight.scales[start:stop], mins)


ERROR_ROWS = 4096  # rows dequantized at a time: keeps the error check far below one fp32 embedding


def relative_error(new: Weight, old: Weight) -> float:
    """||new - old||_F / ||old||_F, both dequantized to fp32, a slab of rows at a time."""
    if new is old:
        return 0.0
    num_rows = old.shape[0]
    diff_sq = ref_sq = 0.0
    for start in range(0, num_rows, ERROR_ROWS):
        stop = min(start + ERROR_ROWS, num_rows)
        ref = dense(_row_slice(old, start, stop))
        diff_sq += (dense(_row_slice(new, start, stop)) - ref).pow(2).sum().item()
        ref_sq += ref.pow(2).sum().item()
    return (diff_sq / ref_sq) ** 0.5 if ref_sq else 0.0
