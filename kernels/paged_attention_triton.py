"""Triton kernels for the paged KV pool: cache write, paged decode (flash-decoding) and prefill.

The dispatch, torch paths, references and the online-softmax invariant are in
kernels.paged_attention; this module is imported only when a Triton path runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kernels.kv_quant import QuantizedKV

_FORMAT_CODES = {"fp32": 0, "bf16": 0, "fp16": 0, "int8": 1, "int4": 2}
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round_half_away(x):
    return tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(0.5 - x))


@triton.jit
def _cache_write_kernel(
    # pointers
    x_ptr, slot_ptr, data_ptr, scale_ptr, zero_ptr,
    # sizes
    num_kv_heads,
    # strides (the last dimension of x is contiguous)
    stride_xt, stride_xh,
    # meta
    HEAD_DIM: tl.constexpr, FMT: tl.constexpr,
):
    """One program quantizes one token's one KV head and stores it in its slot (fp32 math)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slot: padding token
        HALF: tl.constexpr = HEAD_DIM // 2
        row = slot * num_kv_heads + h
        offs = tl.arange(0, HALF)
        src = x_ptr + t * stride_xt + h * stride_xh + 2 * offs
        x_even = tl.load(src)  # (HALF,) channels 0, 2, 4, ...
        x_odd = tl.load(src + 1)  # (HALF,) channels 1, 3, 5, ...
        if FMT == 0:
            dst = data_ptr + row * HEAD_DIM + 2 * offs
            tl.store(dst, x_even.to(data_ptr.dtype.element_ty))
            tl.store(dst + 1, x_odd.to(data_ptr.dtype.element_ty))
        else:
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        if FMT == 1:
            amax = tl.maximum(tl.max(tl.abs(x_even), 0), tl.max(tl.abs(x_odd), 0))
            scale = tl.maximum(amax / 127.0, 1e-6).to(tl.float16)
            tl.store(scale_ptr + row, scale)
            s = scale.to(tl.float32)
            q_even = tl.minimum(tl.maximum(_round_half_away(x_even / s), -127.0), 127.0)
            q_odd = tl.minimum(tl.maximum(_round_half_away(x_odd / s), -127.0), 127.0)
            dst = data_ptr + row * HEAD_DIM + 2 * offs
            tl.store(dst, q_even.to(tl.int8))
            tl.store(dst + 1, q_odd.to(tl.int8))
        if FMT == 2:
            NUM_GROUPS: tl.constexpr = HEAD_DIM // 32
            g_even = tl.reshape(x_even, (NUM_GROUPS, 16))  # even half-channel j is in group j // 16
            g_odd = tl.reshape(x_odd, (NUM_GROUPS, 16))
            zero = tl.minimum(tl.min(g_even, 1), tl.min(g_odd, 1)).to(tl.float16)  # (NUM_GROUPS,)
            z = zero.to(tl.float32)
            span = tl.maximum(tl.max(g_even, 1), tl.max(g_odd, 1)) - z
            scale = tl.maximum(span / 15.0, 1e-6).to(tl.float16)
            s = scale.to(tl.float32)
            q_even = tl.minimum(tl.maximum(tl.floor((g_even - z[:, None]) / s[:, None] + 0.5), 0.0), 15.0)
            q_odd = tl.minimum(tl.maximum(tl.floor((g_odd - z[:, None]) / s[:, None] + 0.5), 0.0), 15.0)
            packed = q_even.to(tl.uint8) | (q_odd.to(tl.uint8) << 4)  # low nibble = even channel
            tl.store(data_ptr + row * HALF + offs, tl.reshape(packed, (HALF,)))
            offs_g = tl.arange(0, NUM_GROUPS)
            tl.store(scale_ptr + row * NUM_GROUPS + offs_g, scale)
            tl.store(zero_ptr + row * NUM_GROUPS + offs_g, zero)


@triton.jit
def _load_kv_halves(data_ptr, scale_ptr, zero_ptr, row, mask_n, offs_h,
                    HEAD_DIM: tl.constexpr, FMT: tl.constexpr):
    """Dequantize a tile of (token, head) rows (BLOCK_N,) -> even, odd channels (BLOCK_N, D/2) fp32."""
    m = mask_n[:, None]
    if FMT == 2:
        packed = tl.load(data_ptr + row[:, None] * (HEAD_DIM // 2) + offs_h[None, :], mask=m, other=0)
        group = row[:, None] * (HEAD_DIM // 32) + offs_h[None, :] // 16
        s = tl.load(scale_ptr + group, mask=m, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + group, mask=m, other=0.0).to(tl.float32)
        even = (packed & 0xF).to(tl.float32) * s + z
        odd = (packed >> 4).to(tl.float32) * s + z
    else:
        src = data_ptr + row[:, None] * HEAD_DIM + 2 * offs_h[None, :]
        even = tl.load(src, mask=m, other=0).to(tl.float32)
        odd = tl.load(src + 1, mask=m, other=0).to(tl.float32)
        if FMT == 1:
            s = tl.load(scale_ptr + row, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            even = even * s
            odd = odd * s
    return even, odd


@triton.jit
def _paged_decode_kernel(
    # pointers
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, q_ptr,
    k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
    block_tables_ptr, context_lens_ptr,
    # sizes
    num_kv_heads, num_partitions, qk_scale,
    # strides (last dimensions contiguous)
    stride_qs, stride_qh, stride_bts, stride_os, stride_oh,
    # meta
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """Program (partition, seq, kv head): the GROUP q heads of one KV head over one partition."""
    part = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = part * PARTITION
    if SINGLE or start < ctx:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_g = tl.arange(0, GROUP_PAD)  # padded to 16 rows so tl.dot can run on tensor cores
        offs_h = tl.arange(0, HALF)
        mask_g = offs_g < GROUP
        heads = kvh * GROUP + offs_g
        q_src = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + 2 * offs_h[None, :]
        q_even = (tl.load(q_src, mask=mask_g[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
        q_odd = (tl.load(q_src + 1, mask=mask_g[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc_even = tl.zeros((GROUP_PAD, HALF), tl.float32)
        acc_odd = tl.zeros((GROUP_PAD, HALF), tl.float32)
        end = tl.minimum(start + PARTITION, ctx)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            bt_src = block_tables_ptr + seq * stride_bts + offs_n // BLOCK_SIZE
            block_ids = tl.load(bt_src, mask=mask_n, other=0)
            row = (block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE) * num_kv_heads + kvh
            k_even, k_odd = _load_kv_halves(k_data_ptr, k_scale_ptr, k_zero_ptr, row, mask_n, offs_h,
                                            HEAD_DIM, K_FMT)
            s = tl.dot(q_even, tl.trans(k_even.to(tl.float16)))
            s += tl.dot(q_odd, tl.trans(k_odd.to(tl.float16)))  # (GROUP_PAD, BLOCK_N) fp32
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_even, v_odd = _load_kv_halves(v_data_ptr, v_scale_ptr, v_zero_ptr, row, mask_n, offs_h,
                                            HEAD_DIM, V_FMT)
            p16 = p.to(tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even.to(tl.float16))
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd.to(tl.float16))
            m_i = m_new
        if SINGLE:
            denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
            dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + 2 * offs_h[None, :]
            tl.store(dst, (acc_even / denom).to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
            tl.store(dst + 1, (acc_odd / denom).to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
        else:
            # partials: m, l (S, Hq, P); acc (S, Hq, P, D)
            idx = (seq * num_kv_heads * GROUP + heads) * num_partitions + part
            tl.store(part_m_ptr + idx, m_i, mask=mask_g)
            tl.store(part_l_ptr + idx, l_i, mask=mask_g)
            dst = part_acc_ptr + idx[:, None] * HEAD_DIM + 2 * offs_h[None, :]
            tl.store(dst, acc_even, mask=mask_g[:, None])
            tl.store(dst + 1, acc_odd, mask=mask_g[:, None])


@triton.jit
def _paged_decode_reduce_kernel(
    # pointers
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, context_lens_ptr,
    # sizes
    num_heads, num_partitions,
    # strides
    stride_os, stride_oh,
    # meta
    HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    """Program (seq, q head): merge the partitions' (m, l, acc) into the output (fp32)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    offs_p = tl.arange(0, PARTS_PAD)
    mask_p = offs_p < tl.cdiv(ctx, PARTITION)
    idx = (seq * num_heads + head) * num_partitions + offs_p
    m = tl.load(part_m_ptr + idx, mask=mask_p, other=float("-inf"))
    l_p = tl.load(part_l_ptr + idx, mask=mask_p, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(mask_p, tl.exp2(m - m_max), 0.0)  # (PARTS_PAD,)
    denom = tl.sum(w * l_p, 0)
    denom = tl.where(denom > 0, denom, 1.0)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_p[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _paged_prefill_kernel(
    # pointers
    out_ptr, q_ptr, k_data_ptr, k_scale_ptr, k_zero_ptr, v_data_ptr, v_scale_ptr, v_zero_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    # sizes
    num_kv_heads, qk_scale,
    # strides (last dimensions contiguous)
    stride_qt, stride_qh, stride_bts, stride_ot, stride_oh,
    # meta
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):
    """Program (query tile, seq, q head): BLOCK_M new tokens attend causally to prefix + themselves."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M < num_new:
        HALF: tl.constexpr = HEAD_DIM // 2
        kvh = head // GROUP
        ctx = tl.load(context_lens_ptr + seq)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < num_new
        pos_m = ctx - num_new + offs_m  # absolute position of each query row
        offs_h = tl.arange(0, HALF)
        q_src = q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + 2 * offs_h[None, :]
        q_even = (tl.load(q_src, mask=mask_m[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
        q_odd = (tl.load(q_src + 1, mask=mask_m[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc_even = tl.zeros((BLOCK_M, HALF), tl.float32)
        acc_odd = tl.zeros((BLOCK_M, HALF), tl.float32)
        end = tl.minimum(ctx, ctx - num_new + (tile + 1) * BLOCK_M)  # keys past the last row: masked
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            bt_src = block_tables_ptr + seq * stride_bts + offs_n // BLOCK_SIZE
            block_ids = tl.load(bt_src, mask=mask_n, other=0)
            row = (block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE) * num_kv_heads + kvh
            k_even, k_odd = _load_kv_halves(k_data_ptr, k_scale_ptr, k_zero_ptr, row, mask_n, offs_h,
                                            HEAD_DIM, K_FMT)
            s = tl.dot(q_even, tl.trans(k_even.to(tl.float16)))
            s += tl.dot(q_odd, tl.trans(k_odd.to(tl.float16)))  # (BLOCK_M, BLOCK_N) fp32
            causal = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is visible to every row
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_even, v_odd = _load_kv_halves(v_data_ptr, v_scale_ptr, v_zero_ptr, row, mask_n, offs_h,
                                            HEAD_DIM, V_FMT)
            p16 = p.to(tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even.to(tl.float16))
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd.to(tl.float16))
            m_i = m_new
        denom = tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + 2 * offs_h[None, :]
        tl.store(dst, (acc_even / denom).to(out_ptr.dtype.element_ty), mask=mask_m[:, None])
        tl.store(dst + 1, (acc_odd / denom).to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV
) -> None:
    """Triton: quantize k, v (T, Hkv, D) into caches at slots (T,); negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_triton_head_dim(head_dim)
    slots = slot_mapping.to(torch.int64).contiguous()
    for x, cache in ((k, k_cache), (v, v_cache)):
        if x.stride(-1) != 1:
            x = x.contiguous()
        fmt = _FORMAT_CODES[cache.kv_dtype]
        scale = cache.scale if cache.scale is not None else cache.data
        zero = cache.zero if cache.zero is not None else cache.data
        _cache_write_kernel[(num_tokens, num_kv_heads)](
            x, slots, cache.data, scale, zero,
            num_kv_heads,
            x.stride(0), x.stride(1),
            HEAD_DIM=head_dim, FMT=fmt,
        )


def decode_triton(q, pool, layer, block_tables, context_lens, scale, max_context_len, partition_size):
    num_seqs, num_heads, head_dim = q.shape
    _check_triton_head_dim(head_dim)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    group = num_heads // pool.num_kv_heads
    num_partitions = max(1, triton.cdiv(max_context_len, partition_size))
    out = torch.empty_like(q)
    single = num_partitions == 1
    if single:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32,
                               device=q.device)
    kc, vc = pool.k_caches[layer], pool.v_caches[layer]
    _paged_decode_kernel[(num_partitions, num_seqs, pool.num_kv_heads)](
        out, part_m, part_l, part_acc, q,
        *_cache_ptrs(kc), *_cache_ptrs(vc),
        block_tables, context_lens,
        pool.num_kv_heads, num_partitions, scale * _LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=pool.block_size, BLOCK_N=min(64, partition_size), PARTITION=partition_size,
        K_FMT=_FORMAT_CODES[kc.kv_dtype], V_FMT=_FORMAT_CODES[vc.kv_dtype], SINGLE=single,
    )
    if not single:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_m, part_l, part_acc, context_lens,
            num_heads, num_partitions,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, PARTITION=partition_size,
            PARTS_PAD=triton.next_power_of_2(num_partitions),
        )
    return out


def prefill_triton(q, pool, layer, block_tables, context_lens, query_start_loc, scale, max_query_len,
                    block_m: int = 16, block_n: int = 16):
    total, num_heads, head_dim = q.shape
    _check_triton_head_dim(head_dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if total == 0:
        return out
    if q.is_cuda:
        block_m, block_n = 64, 64
    kc, vc = pool.k_caches[layer], pool.v_caches[layer]
    num_seqs = context_lens.shape[0]
    _paged_prefill_kernel[(triton.cdiv(max(1, max_query_len), block_m), num_seqs, num_heads)](
        out, q, *_cache_ptrs(kc), *_cache_ptrs(vc),
        block_tables, context_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous(),
        pool.num_kv_heads, scale * _LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // pool.num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=pool.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        K_FMT=_FORMAT_CODES[kc.kv_dtype], V_FMT=_FORMAT_CODES[vc.kv_dtype],
    )
    return out


def _cache_ptrs(cache: QuantizedKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """data, scale, zero for a kernel; absent ones alias data (never read for that format)."""
    scale = cache.scale if cache.scale is not None else cache.data
    zero = cache.zero if cache.zero is not None else cache.data
    return cache.data, scale, zero


def _check_triton_head_dim(head_dim: int) -> None:
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton KV kernels need head_dim a power of two >= 32, got {head_dim}")
