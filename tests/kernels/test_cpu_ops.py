"""The C++ AVX2 CPU ops (kernels.cpu_ops) against their torch references.

Random, off-centre inputs; sizes that are not multiples of the ops' tiles (4 activation rows,
4 weight rows, 8 channels, 32-channel value chunks, 16-token blocks). Skipped where the ops
cannot be built (no AVX2 or no compiler): the torch paths then run everywhere instead.
"""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_paged_attention import LAYER, _q, build

from kernels import cpu_ops
from kernels.dispatch import CPU_KERNEL_MAX_M, choose_backend, linear, prepare_linear
from kernels.paged_attention import paged_decode_attention_reference
from kernels.reference import int4_gemm_reference, int8_gemm_reference, int16_activation_gemm_reference
from quant.formats import quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the AVX2 CPU ops do not build here")


def _weight(n, k, group, scale_dtype, seed, fmt="int4"):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=gen) * 0.2 + 0.05
    if fmt == "int8":
        w = quantize_int8(dense, group)
        return replace(w, scales=w.scales.to(scale_dtype))
    w = quantize_int4(dense, group)
    return replace(w, scales=w.scales.to(scale_dtype), mins=w.mins.to(scale_dtype))


# format -> (prepare, the kernel's linear, the exact fp32 reference)
KERNELS = {
    "int4": (cpu_ops.prepare_int4, cpu_ops.int4_linear, int4_gemm_reference),
    "int8": (cpu_ops.prepare_int8, cpu_ops.int8_linear, int8_gemm_reference),
}


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n,k,group", [(37, 96, 32), (50, 128, 64), (9, 32, 32), (130, 224, 32)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9, 17])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_quantized_gemm_matches_references(fmt, n, k, group, m, scale_dtype):
    prepare, kernel_linear, exact_reference = KERNELS[fmt]
    weight = _weight(n, k, group, scale_dtype, seed=n + m, fmt=fmt)
    if fmt == "int8":
        assert int(weight.qweight.abs().max()) == 127  # full-range codes: the int32 lanes' worst case
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2 + 0.3
    out = kernel_linear(x, prepare(weight))
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # Same int16 rounding of x: equal up to fp32 summation order.
    torch.testing.assert_close(out, int16_activation_gemm_reference(x, weight), rtol=1e-5, atol=1e-4)
    # Against the exact product: int16 activations with a scale per 4 values cost ~1e-5.
    exact = exact_reference(x, weight)
    assert float((out - exact).norm() / exact.norm()) < 1e-4


def test_int4_gemm_takes_bf16_activations():
    weight = _weight(33, 64, 32, torch.float16, seed=2)
    x = (torch.randn(2, 64) + 0.5).to(torch.bfloat16)
    out = cpu_ops.int4_linear(x, cpu_ops.prepare_int4(weight))
    torch.testing.assert_close(out, int16_activation_gemm_reference(x.float(), weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_dequantize_into_a_longer_buffer_matches_the_weight(scale_dtype):
    weight = _weight(45, 160, 32, scale_dtype, seed=4)
    scratch = torch.full((45 * 160 + 77,), float("nan"))
    out = cpu_ops.dequantize_into(cpu_ops.prepare_int4(weight), scratch)
    torch.testing.assert_close(out, weight.dequantize(torch.float32), rtol=0, atol=1e-6)
    assert torch.isnan(scratch[45 * 160:]).all()  # nothing written past N * K


def test_int4_errors_name_the_problem():
    weight = quantize_int4(torch.randn(8, 48), 16)
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_ops.prepare_int4(weight)
    prepared = cpu_ops.prepare_int4(_weight(8, 64, 32, torch.float16, seed=1))
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 32"):
        torch.ops.edgeinfer_cpu.int4_gemm(torch.randn(1, 64), prepared.packed, prepared.scales, prepared.mins, 16)
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\)"):
        cpu_ops.int4_linear(torch.randn(1, 63), prepared)


def test_int8_prepare_keeps_fp16_weights_and_errors_name_the_problem():
    weight = _weight(8, 64, 32, torch.float16, seed=1, fmt="int8")
    assert cpu_ops.prepare_int8(weight) is weight  # a Q8_0 tensor runs as loaded: no copy
    with pytest.raises(ValueError, match="K a multiple of 32"):
        cpu_ops.prepare_int8(quantize_int8(torch.randn(8, 48), 16))
    with pytest.raises(ValueError, match="group 16 or a multiple of 32"):
        cpu_ops.prepare_int8(quantize_int8(torch.randn(8, 64), 8))
    gemm = torch.ops.edgeinfer_cpu.int8_gemm
    with pytest.raises(RuntimeError, match="int8 weight must be contiguous int8"):
        gemm(torch.randn(1, 64), weight.qweight.to(torch.int16), weight.scales, None, 32)
    with pytest.raises(RuntimeError, match="group_size must be 16 or a positive multiple of 32 dividing K=64"):
        gemm(torch.randn(1, 64), weight.qweight, weight.scales, None, 48)
    with pytest.raises(RuntimeError, match="scales must be contiguous and hold N \\* K / group_size values"):
        gemm(torch.randn(1, 64), weight.qweight, weight.scales[:4], None, 32)
    with pytest.raises(RuntimeError, match="mins must be contiguous, of the scales' dtype and count"):
        gemm(torch.randn(1, 64), weight.qweight, weight.scales, weight.scales.float(), 32)
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\)"):
        cpu_ops.int8_linear(torch.randn(1, 63), weight)


def _int8_with(n, k, group, mins, seed):
    """int8 as GGUF brings it: groups of 16 (Q6_K) or 32, with mins (Q5_1/Q5_K) or not; fp16."""
    gen = torch.Generator().manual_seed(seed)
    w = quantize_int8(torch.randn(n, k, generator=gen) * 0.2, group)
    offsets = (torch.rand(n, k // group, generator=gen) - 1.2) * 0.3 if mins else None  # never zero
    return replace(w, scales=w.scales.half(), mins=None if offsets is None else offsets.half())


@pytest.mark.parametrize("group,mins", [(16, False), (16, True), (32, True), (64, True)])
@pytest.mark.parametrize("n,k", [(37, 576), (21, 1536)])
@pytest.mark.parametrize("m", [1, 3, 5, 17])
def test_int8_with_mins_and_group_16_matches_references(group, mins, n, k, m):
    weight = _int8_with(n, k, group, mins, seed=n + m + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 2 + 0.3
    out = cpu_ops.int8_linear(x, cpu_ops.prepare_int8(weight))
    torch.testing.assert_close(out, int16_activation_gemm_reference(x, weight), rtol=1e-5, atol=1e-4)
    exact = int8_gemm_reference(x, weight)
    assert float((out - exact).norm() / exact.norm()) < 1e-4
    # The per-op path's wide rows: dequantize (mins and groups of 16 included) + fp32 GEMM.
    prepared = prepare_linear(weight, choose_backend("int4_cpu"))
    assert prepared.path == "int8_cpu"
    wide = torch.randn(CPU_KERNEL_MAX_M + 3, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(linear(wide, prepared), int8_gemm_reference(wide, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 31, 63, 64, 70])
@pytest.mark.parametrize("fmt,scale_dtype", [("int4", torch.float16), ("int8", torch.float16),
                                             ("int8", torch.bfloat16)])
def test_dispatch_uses_the_kernel_for_decode_and_dequantizes_for_prefill(m, fmt, scale_dtype):
    weight = _weight(70, 96, 32, scale_dtype, seed=m, fmt=fmt)
    prepared = prepare_linear(weight, choose_backend("int4_cpu"))
    if fmt == "int4":
        assert isinstance(prepared.kernel, cpu_ops.CpuInt4Weight) and prepared.packed is None
    else:  # used as loaded, bf16 scales made fp32
        assert prepared.path == "int8_cpu"
        assert prepared.source.scales.dtype == (torch.float16 if scale_dtype == torch.float16 else torch.float32)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(9)) + 0.2
    scratch = torch.full((70 * 96 + 5,), float("nan"))
    out = linear(x, prepared, scratch)
    if m <= CPU_KERNEL_MAX_M:
        torch.testing.assert_close(out, int16_activation_gemm_reference(x, weight), rtol=1e-5, atol=1e-4)
    else:  # dequantize + fp32 GEMM: exact up to summation order
        torch.testing.assert_close(out, KERNELS[fmt][2](x, weight).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 37), (19, 64)])
def test_rms_norm_matches_torch(rows, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3 + 0.5
    weight = torch.rand(hidden, generator=gen) + 0.5
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (hidden,), weight, 1e-5),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_rows,per_row,hidden", [(1, 64, 576), (3, 5, 37), (2, 7, 8)])
def test_refine_logits_matches_einsum_and_scatter(num_rows, per_row, hidden):
    gen = torch.Generator().manual_seed(hidden + per_row)
    logits = torch.randn(num_rows, 101, generator=gen)
    h = torch.randn(num_rows, hidden, generator=gen) + 0.3
    ids = torch.stack([torch.randperm(101, generator=gen)[:per_row] for _ in range(num_rows)])
    rows = torch.randn(num_rows * per_row, hidden, generator=gen) * 0.1
    want = logits.clone().scatter_(-1, ids, torch.einsum("lh,lrh->lr", h, rows.view(num_rows, per_row, hidden)))
    cpu_ops.refine_logits(logits, h, ids, rows)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_refine_logits_errors_name_the_problem():
    logits, h, rows = torch.zeros(1, 10), torch.ones(1, 8), torch.ones(2, 8)
    with pytest.raises(IndexError, match="id 10 is outside"):
        cpu_ops.refine_logits(logits, h, torch.tensor([[3, 10]]), rows)
    with pytest.raises(RuntimeError, match="rows must be contiguous fp32"):
        cpu_ops.refine_logits(logits, h, torch.tensor([[3, 4]]), torch.ones(3, 8))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_dim,group", [(64, 3), (40, 2), (8, 1)])
# Few sequences with long contexts are split into context parts and merged; [1, 200] leaves the
# 1-token context an empty part.
@pytest.mark.parametrize("lens", [[1, 17, 40, 5], [300], [1, 200]])
def test_decode_attention_matches_reference(dtype, head_dim, group, lens):
    # The pool test_paged_attention builds: shuffled blocks, lengths off the block size.
    pool, tables = build(dtype, dtype, head_dim, 2, lens, block_size=16, seed=head_dim + group)
    q = _q((len(lens), 2 * group, head_dim), seed=group)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    kc, vc = pool.k_caches[LAYER].data, pool.v_caches[LAYER].data
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, context_lens, head_dim ** -0.5)
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, context_lens, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_merges_context_parts_with_an_empty_one():
    # One KV head, two sequences: fewer pairs than two per thread, so contexts split in parts;
    # the 1-token context leaves its first part empty.
    lens = [1, 200]
    pool, tables = build("fp32", "fp32", 64, 1, lens, block_size=16, seed=5)
    q = _q((2, 3, 64), seed=5)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = cpu_ops.paged_decode_attention(q, pool.k_caches[LAYER].data, pool.v_caches[LAYER].data, tables,
                                             context_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, context_lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_rejects_a_length_past_its_block_table():
    kc = torch.randn(4, 16, 1, 8)
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] exceeds its block table"):
        cpu_ops.paged_decode_attention(torch.randn(1, 1, 8), kc, kc.clone(), torch.zeros(1, 2, dtype=torch.int32),
                                       torch.tensor([33], dtype=torch.int32), 1.0)


def test_env_var_turns_the_ops_off():
    code = "from kernels import cpu_ops; print(cpu_ops.available())"
    env = {**os.environ, cpu_ops.KERNEL_ENV: "torch"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "False"


def test_the_compile_progress_bar_counts_the_object_files_ninja_writes(tmp_path, monkeypatch) -> None:
    import time

    import tqdm

    shown: list[int] = []

    class Bar:  # records what a terminal would show
        def __init__(self, total: int, **_: object) -> None:
            self.total, self.n = total, 0

        def __enter__(self) -> "Bar":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, k: int) -> None:
            self.n += k
            shown.append(self.n)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    with cpu_ops._compile_progress(tmp_path, 3):
        for name in ("a.o", "b.o", "c.o"):
            (tmp_path / name).touch()
            time.sleep(0.6)  # the watcher looks every 0.5 s
    assert shown[-1] == 3 and shown == sorted(shown)
