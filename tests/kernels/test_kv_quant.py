"""KV formats: quantize/dequantize round trips, error bounds, packing, and pool sizing."""

import pytest
import torch

from kernels.kv_pool import KVPool, kv_bytes_per_token
from kernels.kv_quant import INT4_GROUP, dequantize_kv, kv_bytes_per_element, quantize_kv


def _kv(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * 2.0 + 0.3  # not centred, never all zero


@pytest.mark.parametrize("kv_dtype,dtype", [("fp32", torch.float32), ("fp16", torch.float16),
                                            ("bf16", torch.bfloat16)])
def test_plain_round_trip(kv_dtype, dtype):
    x = _kv((5, 3, 64))
    q = quantize_kv(x, kv_dtype)
    assert q.data.dtype == dtype and q.scale is None
    torch.testing.assert_close(dequantize_kv(q), x.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_int8_round_trip_error_bound(head_dim):
    x = _kv((7, 3, head_dim), seed=1)
    q = quantize_kv(x, "int8")
    assert q.data.dtype == torch.int8 and q.data.shape == x.shape
    assert q.scale.shape == (7, 3) and q.scale.dtype == torch.float16
    err = (dequantize_kv(q) - x).abs()
    step = q.scale.float()[..., None]
    assert bool((err <= step * 0.5 + 1e-6).all()), float((err / step).max())
    assert float(q.data.abs().max()) == 127  # the largest value uses the full range


@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_int4_round_trip_error_bound(head_dim):
    x = _kv((7, 3, head_dim), seed=2)
    q = quantize_kv(x, "int4")
    groups = head_dim // INT4_GROUP
    assert q.data.dtype == torch.uint8 and q.data.shape == (7, 3, head_dim // 2)
    assert q.scale.shape == q.zero.shape == (7, 3, groups)
    err = (dequantize_kv(q) - x).abs().unflatten(-1, (groups, INT4_GROUP))
    step = q.scale.float()[..., None]
    # Half a step from rounding, plus what rounding the group minimum to fp16 can shift.
    slack = (q.zero.float().abs() * 2**-11)[..., None] + 1e-6
    assert bool((err <= step * 0.5 + slack).all()), float((err / step).max())


def test_int4_packing_low_nibble_is_even_channel():
    codes = torch.arange(64) % 16  # group 0: 0..15, 0..15; zero = 0 and scale = 1 exactly
    q = quantize_kv(codes.float().view(1, 1, 64), "int4")
    assert q.zero.flatten().tolist() == [0.0, 0.0] and q.scale.flatten().tolist() == [1.0, 1.0]
    assert q.data[0, 0, 0].item() == 0 | (1 << 4) and q.data[0, 0, 1].item() == 2 | (3 << 4)
    torch.testing.assert_close(dequantize_kv(q).flatten(), codes.float())


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_constant_and_zero_tokens_stay_finite(kv_dtype):
    x = torch.zeros(2, 2, 64)
    x[1] = 3.5
    y = dequantize_kv(quantize_kv(x, kv_dtype))
    assert bool(torch.isfinite(y).all())
    torch.testing.assert_close(y, x, rtol=0, atol=1e-3)


def test_bad_formats_raise():
    with pytest.raises(ValueError, match="kv dtype"):
        quantize_kv(torch.ones(1, 1, 64), "int3")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_kv(torch.ones(1, 1, 48), "int4")


@pytest.mark.parametrize("k_dtype,v_dtype", [("fp16", "fp16"), ("int8", "int8"), ("int4", "int4"),
                                             ("int8", "int4"), ("fp32", "bf16")])
def test_pool_bytes_per_token_matches_storage(k_dtype, v_dtype):
    pool = KVPool(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=64,
                  k_dtype=k_dtype, v_dtype=v_dtype)
    assert pool.bytes_per_token() * pool.num_slots == pool.nbytes()
    assert pool.bytes_per_token() == kv_bytes_per_token(3, 2, 64, k_dtype, v_dtype)


def test_bytes_per_element():
    assert kv_bytes_per_element("fp16", 128) == 2
    assert kv_bytes_per_element("int8", 128) == 1 + 2 / 128
    assert kv_bytes_per_element("int4", 128) == 0.5 + 4 / 32


def test_pool_write_gather_round_trip_and_copy_blocks():
    pool = KVPool(2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=64, k_dtype="int8", v_dtype="int4")
    k, v = _kv((6, 2, 64), seed=3), _kv((6, 2, 64), seed=4)
    slots = torch.tensor([9, 10, 11, 20, -1, 21])  # block 2 offsets 1-3, block 5 offsets 0-1; one pad
    pool.write(1, k, v, slots)
    gk, gv = pool.gather(1, torch.tensor([[2, 5]]))  # (1, 2, 4, 2, 64)
    flat_k, flat_v = gk.flatten(1, 2)[0], gv.flatten(1, 2)[0]  # (8, 2, 64): slots 8..11, 20..23
    rows = [1, 2, 3, 4, 5]
    keep = [0, 1, 2, 3, 5]
    torch.testing.assert_close(flat_k[rows], dequantize_kv(quantize_kv(k[keep], "int8")))
    torch.testing.assert_close(flat_v[rows], dequantize_kv(quantize_kv(v[keep], "int4")))
    assert float(pool.gather(0, torch.tensor([2]))[0].abs().max()) == 0  # layer 0 untouched
    pool.copy_blocks([(2, 0)])
    torch.testing.assert_close(pool.gather(1, torch.tensor([0]))[1], pool.gather(1, torch.tensor([2]))[1])
