"""W4A16 / W8A16 Triton GEMM kernels against float64 math, their torch references, and concat_rows.

Error bound: relative Frobenius error ||y - y64|| / ||y64|| against x.double() @ W.double().T on the
same (rounded) inputs. The kernels accumulate in fp32, so what is left is the final rounding of y
to the activation dtype: about 2^-9 relative for bf16 and 2^-12 for fp16; the bounds below leave
room of about 4x. On the CPU the kernels run under TRITON_INTERPRET=1 with small shapes.
"""

from __future__ import annotations

import pytest
import torch

from kernels.int4_gemm import GemmConfig, int4_gemm, prepare_int4
from kernels.int8_gemm import int8_gemm, prepare_int8
from kernels.reference import int4_gemm_reference, int8_gemm_reference
from quant.formats import QuantizedTensor, concat_rows, quantize_int4, quantize_int8

BOUND = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel_err(y: torch.Tensor, x: torch.Tensor, weight: QuantizedTensor) -> float:
    exact = x.double() @ weight.dequantize(torch.float64).t()
    return ((y.double() - exact).norm() / exact.norm()).item()


def _int4(n: int, k: int, group: int, scale_dtype: torch.dtype, device: str = DEVICE) -> QuantizedTensor:
    qt = quantize_int4(torch.randn(n, k), group)
    assert qt.mins is not None
    return QuantizedTensor(
        "int4", qt.shape, group, qt.qweight.to(device), qt.scales.to(device, scale_dtype),
        qt.mins.to(device, scale_dtype),
    )  # fmt: skip


def _int8(
    n: int, k: int, group: int | None, scale_dtype: torch.dtype, device: str = DEVICE
) -> QuantizedTensor:
    qt = quantize_int8(torch.randn(n, k), group)
    return QuantizedTensor(
        "int8", qt.shape, qt.group_size, qt.qweight.to(device), qt.scales.to(device, scale_dtype)
    )


def _x(m: int, k: int, dtype: torch.dtype, device: str = DEVICE) -> torch.Tensor:
    return torch.randn(m, k, device=device).to(dtype)


# (M, N, K, group, activation dtype, scale dtype): M 1 and 3 take the thin split-K schedule, 17 and
# 33 the tiled one; N is never a multiple of a block; K is 576 (not a multiple of 128) or an odd
# number of groups.
INT4_CASES = [
    (1, 40, 576, 32, torch.float16, torch.float16),
    (1, 72, 224, 32, torch.bfloat16, torch.float32),
    (3, 40, 192, 64, torch.float16, torch.float32),
    (3, 72, 576, 64, torch.bfloat16, torch.float16),
    (1, 72, 384, 128, torch.bfloat16, torch.float16),
    (3, 40, 384, 128, torch.float16, torch.float32),
    (17, 72, 224, 32, torch.float16, torch.float16),
    (17, 40, 640, 128, torch.bfloat16, torch.float32),
    (33, 40, 192, 64, torch.bfloat16, torch.float16),
    (33, 72, 576, 32, torch.float16, torch.float32),
]


@pytest.mark.parametrize("m, n, k, group, dtype, scale_dtype", INT4_CASES)
def test_int4_gemm_matches_reference(m, n, k, group, dtype, scale_dtype):
    torch.manual_seed(m * 1000 + n + k + group)
    weight, x = _int4(n, k, group, scale_dtype), _x(m, k, dtype)
    y = int4_gemm(x, prepare_int4(weight))
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel_err(y, x, weight) < BOUND[dtype]
    assert _rel_err(int4_gemm_reference(x, weight), x, weight) < BOUND[dtype]


# Per-channel int8 (group None, i.e. group = K) included; K = 576 per channel takes BLOCK_K = 64.
INT8_CASES = [
    (1, 40, 576, None, torch.float16, torch.float32),
    (1, 72, 224, 32, torch.bfloat16, torch.float16),
    (3, 40, 192, 64, torch.bfloat16, torch.float32),
    (3, 72, 384, 128, torch.float16, torch.float16),
    (1, 40, 576, 64, torch.bfloat16, torch.float16),
    (17, 72, 576, None, torch.bfloat16, torch.float32),
    (17, 40, 224, 32, torch.float16, torch.float16),
    (33, 72, 384, 128, torch.bfloat16, torch.float32),
    (33, 40, 576, 64, torch.float16, torch.float16),
]


# GGUF's int8: groups of 16 (Q6_K) and mins (Q5_1/Q5_K); mins drawn away from zero.
INT8_MIN_CASES = [
    (1, 40, 576, 16, False, torch.float16),
    (3, 72, 1536, 16, True, torch.float16),
    (17, 40, 576, 32, True, torch.bfloat16),
    (33, 72, 1536, 16, True, torch.float16),
]


@pytest.mark.parametrize("m, n, k, group, mins, dtype", INT8_MIN_CASES)
def test_int8_gemm_with_mins_and_group_16_matches_reference(m, n, k, group, mins, dtype):
    torch.manual_seed(m + n + k + group)
    weight = _int8(n, k, group, torch.float16)
    if mins:
        weight = QuantizedTensor("int8", weight.shape, group, weight.qweight, weight.scales,
                                 ((torch.rand(n, k // group) - 1.2) * 0.3).to(DEVICE, torch.float16))
    x = _x(m, k, dtype)
    y = int8_gemm(x, prepare_int8(weight))
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel_err(y, x, weight) < BOUND[dtype]
    assert _rel_err(int8_gemm_reference(x, weight), x, weight) < BOUND[dtype]


@pytest.mark.parametrize("m, n, k, group, dtype, scale_dtype", INT8_CASES)
def test_int8_gemm_matches_reference(m, n, k, group, dtype, scale_dtype):
    torch.manual_seed(m * 1000 + n + k + (group or 0))
    weight, x = _int8(n, k, group, scale_dtype), _x(m, k, dtype)
    y = int8_gemm(x, prepare_int8(weight))
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel_err(y, x, weight) < BOUND[dtype]
    assert _rel_err(int8_gemm_reference(x, weight), x, weight) < BOUND[dtype]


@pytest.mark.parametrize("split_k", [1, 3, 16])
def test_split_k_paths_agree(split_k):
    # 16 splits of 9 K tiles leaves some splits empty: they must add nothing.
    torch.manual_seed(split_k)
    weight4, weight8 = _int4(40, 576, 64, torch.float16), _int8(40, 576, 64, torch.float16)
    x = _x(2, 576, torch.float16)
    config = GemmConfig(16, 32, 64, split_k=split_k)
    assert _rel_err(int4_gemm(x, prepare_int4(weight4), config=config), x, weight4) < BOUND[torch.float16]
    assert _rel_err(int8_gemm(x, prepare_int8(weight8), config=config), x, weight8) < BOUND[torch.float16]


def test_strided_and_fp32_activations():
    torch.manual_seed(7)
    weight4, weight8 = _int4(40, 192, 32, torch.float32), _int8(40, 192, None, torch.float32)
    x = _x(5, 384, torch.float16)[:, ::2]  # K stride 2
    assert _rel_err(int4_gemm(x, prepare_int4(weight4)), x, weight4) < BOUND[torch.float16]
    assert _rel_err(int8_gemm(x, prepare_int8(weight8)), x, weight8) < BOUND[torch.float16]
    x32 = _x(3, 192, torch.float32)
    assert _rel_err(int4_gemm(x32, prepare_int4(weight4)), x32, weight4) < BOUND[torch.float32]
    assert _rel_err(int8_gemm(x32, prepare_int8(weight8)), x32, weight8) < BOUND[torch.float32]


def test_empty_batch():
    weight = prepare_int4(_int4(40, 64, 32, torch.float16))
    assert int4_gemm(_x(0, 64, torch.float16), weight).shape == (0, 40)


# ---- clear errors on bad input ---------------------------------------------------------------------


def test_bad_activations_raise():
    w4 = prepare_int4(_int4(40, 64, 32, torch.float16))
    w8 = prepare_int8(_int8(40, 64, None, torch.float16))
    for gemm, weight in ((int4_gemm, w4), (int8_gemm, w8)):
        with pytest.raises(ValueError, match="2-D"):
            gemm(_x(2, 64, torch.float16)[None], weight)
        with pytest.raises(ValueError, match="K=48"):
            gemm(_x(2, 48, torch.float16), weight)
        with pytest.raises(ValueError, match="torch.int32"):
            gemm(torch.ones(2, 64, dtype=torch.int32, device=DEVICE), weight)
        with pytest.raises(ValueError, match="Weight"):
            gemm(_x(2, 64, torch.float16), w8 if weight is w4 else w4)


def test_bad_weights_and_configs_raise():
    with pytest.raises(ValueError, match="int4 weight"):
        prepare_int4(_int8(40, 64, None, torch.float16))
    with pytest.raises(ValueError, match="int8 weight"):
        prepare_int8(_int4(40, 64, 32, torch.float16))
    with pytest.raises(ValueError, match="multiple of 32"):
        prepare_int4(quantize_int4(torch.randn(8, 64), 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        prepare_int8(quantize_int8(torch.randn(8, 40)))
    with pytest.raises(ValueError, match="block_k=128"):
        int4_gemm(_x(1, 64, torch.float16), prepare_int4(_int4(40, 64, 32, torch.float16)),
                  config=GemmConfig(16, 32, 128))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(16, 40, 32)


# ---- concat_rows ------------------------------------------------------------------------------------


def test_concat_rows_stacks_along_n():
    torch.manual_seed(3)
    for parts in (
        [_int4(n, 128, 32, torch.float16, "cpu") for n in (24, 8, 8)],
        [_int8(n, 128, None, torch.float32, "cpu") for n in (16, 40)],
    ):
        fused = concat_rows(parts)
        assert fused.shape == (sum(p.shape[0] for p in parts), 128)
        torch.testing.assert_close(
            fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0
        )


def test_concat_rows_rejects_mismatches():
    a = _int4(8, 128, 32, torch.float16, "cpu")
    with pytest.raises(ValueError, match="group size 64 vs 32"):
        concat_rows([a, _int4(8, 128, 64, torch.float16, "cpu")])
    with pytest.raises(ValueError, match="format int8 vs int4"):
        concat_rows([a, _int8(8, 128, 32, torch.float16, "cpu")])
    with pytest.raises(ValueError, match="K 256 vs 128"):
        concat_rows([a, _int4(8, 256, 32, torch.float16, "cpu")])
    with pytest.raises(ValueError, match="scales dtype"):
        concat_rows([a, _int4(8, 128, 32, torch.float32, "cpu")])
    with pytest.raises(ValueError, match="at least one"):
        concat_rows([])


# ---- compiled kernels on a GPU: larger shapes, tuned configs ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_gemm_gpu(m, dtype, group):
    torch.manual_seed(m)
    for n, k in ((4096, 4096), (1000, 3 * 1024 + group)):
        weight, x = _int4(n, k, group, torch.float16), _x(m, k, dtype)
        assert _rel_err(int4_gemm(x, prepare_int4(weight)), x, weight) < BOUND[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [None, 128])
def test_int8_gemm_gpu(m, dtype, group):
    torch.manual_seed(m)
    for n, k in ((4096, 4096), (1000, 3 * 1024 + 128)):
        weight, x = _int8(n, k, group, torch.float16), _x(m, k, dtype)
        assert _rel_err(int8_gemm(x, prepare_int8(weight)), x, weight) < BOUND[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_thin_configs_gpu(split_k):
    torch.manual_seed(split_k)
    weight, x = _int4(4096, 4096, 64, torch.float16), _x(8, 4096, torch.float16)
    for block_n in (16, 32, 64, 128):
        y = int4_gemm(x, prepare_int4(weight), config=GemmConfig(16, block_n, 64, split_k=split_k))
        assert _rel_err(y, x, weight) < BOUND[torch.float16]
