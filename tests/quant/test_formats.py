"""Quantization pairs round-trip; bad tensors are refused with a reason."""

import pytest
import torch

from quant.formats import (
    QuantizedTensor,
    as_int8,
    concat_rows,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def test_pack_unpack_round_trip() -> None:
    q = torch.randint(0, 16, (7, 38), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert pack_int4(torch.tensor([[1, 2]]))[0, 0] == 0x21  # element 0 low nibble


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_bound_and_requantization_is_exact(group: int) -> None:
    w = torch.randn(5, group * 3)
    qt = quantize_int4(w, group)
    err = (qt.dequantize() - w).abs()
    step = qt.scales.float().repeat_interleave(group, dim=1)
    assert bool((err <= step / 2 + 1e-6).all())
    again = quantize_int4(qt.dequantize(), group)
    assert torch.equal(unpack_int4(again.qweight), unpack_int4(qt.qweight))


@pytest.mark.parametrize("group", [None, 32])
def test_int8_error_bound(group: int | None) -> None:
    w = torch.randn(9, 96)
    qt = quantize_int8(w, group)
    step = qt.scales.float().repeat_interleave(qt.group_size, dim=1)
    assert bool(((qt.dequantize() - w).abs() <= step / 2 + 1e-6).all())


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="group_size 32 does not divide K=40"):
        QuantizedTensor("int8", (2, 40), 32, torch.zeros(2, 40, dtype=torch.int8), torch.ones(2, 1))
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        QuantizedTensor("int3", (2, 32), 32, torch.zeros(2, 32), torch.ones(2, 1))
    with pytest.raises(ValueError, match="int4 needs mins"):
        QuantizedTensor("int4", (2, 32), 32, torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 1))


def test_to_moves_every_tensor_and_keeps_the_weight() -> None:
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for q in (quantize_int4(w, 32), quantize_int8(w, 32)):
        moved = q.to("meta")
        assert (moved.format, moved.shape, moved.group_size) == (q.format, q.shape, q.group_size)
        assert all(t.device.type == "meta" for t in (moved.qweight, moved.scales))
        assert (moved.mins is None) == (q.mins is None) and (q.mins is None or moved.mins.device.type == "meta")
        assert torch.equal(q.to("cpu").dequantize(), q.dequantize())


@pytest.mark.parametrize("fmt,group,to", [("int4", 32, 16), ("int4", 64, 32), ("int8", 32, 16), ("int8", 16, 16)])
def test_as_int8_is_exact(fmt: str, group: int, to: int) -> None:
    w = torch.randn(6, 128)
    qt = quantize_int4(w, group) if fmt == "int4" else quantize_int8(w, group)
    converted = as_int8(qt, to, torch.float32)
    assert converted.format == "int8" and converted.group_size == to and converted.mins is not None
    assert torch.equal(converted.dequantize(), qt.dequantize())


def test_int8_mins_are_checked_and_dequantized() -> None:
    qt = quantize_int8(torch.randn(4, 64), 16)
    mins = torch.randn(4, 4)
    with_mins = QuantizedTensor("int8", qt.shape, 16, qt.qweight, qt.scales, mins)
    assert torch.equal(with_mins.dequantize(), qt.dequantize() + mins.repeat_interleave(16, dim=1))
    with pytest.raises(ValueError, match="mins have shape"):
        QuantizedTensor("int8", qt.shape, 16, qt.qweight, qt.scales, mins[:, :2])
    with pytest.raises(ValueError, match="mins True vs False"):
        concat_rows([with_mins, qt])
