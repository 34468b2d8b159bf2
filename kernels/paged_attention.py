"""Attention over the paged, quantized KV pool: cache write, decode, and chunked-prefill attention.

Entry points (one dispatch each: Triton on CUDA, the vectorised torch path elsewhere,
``use_triton=True`` forces Triton, e.g. under TRITON_INTERPRET=1):

- ``write_kv_cache``: quantize new K/V (T, Hkv, D) and scatter them into slots (KVPool.write).
- ``paged_decode_attention``: one query token per sequence, q (S, Hq, D).
- ``paged_prefill_attention``: varlen new tokens q (total, Hq, D), sequence i's rows are
  ``query_start_loc[i]:query_start_loc[i + 1]`` and sit at the end of its context, causal.

Conventions shared by all: the new tokens' K/V are written to the pool *before* attention, so
``context_lens`` (S,) counts them (decode and prefill read the same quantized bytes);
``block_tables`` (S, max_blocks) int32 maps logical block j of sequence i to a pool block;
q head h reads KV head ``h // (Hq // Hkv)`` (GQA, as HF's repeat_kv). Outputs have q's dtype.

Online softmax invariant (both kernels): after each K/V tile, for every query row, ``m`` is the
running max of its scores (log2 domain: q is pre-scaled by ``scale * log2(e)``), ``l`` the sum
of ``exp2(score - m)`` and ``acc`` the matching weighted sum of V, all in fp32; a new tile
rescales both by ``exp2(m_old - m_new)``. Flash-decoding splits a sequence into partitions of
``partition_size`` tokens that each keep (m, l, acc); the reduce kernel merges them, so a single
long sequence still fills the GPU. The kernels work on even and odd channels as two halves,
which is how int4 stores them (low / high nibble), so every format shares one code path.

The kernels assume the pool's contiguous layout (kernels.kv_pool), so a (token, KV head) row
index ``slot * Hkv + head`` locates data, scale and zero alike. This module holds no state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.kv_quant import QuantizedKV, dequantize_kv, quantize_kv

if TYPE_CHECKING:
    from kernels.kv_pool import KVCache, KVPool

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


# ----------------------------------------------------------------------------------------------
# Cache write
# ----------------------------------------------------------------------------------------------


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: KVCache, v_cache: KVCache
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


def write_kv_cache_reference(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: KVCache, v_cache: KVCache
) -> None:
    """Torch: the same as write_kv_cache (the production path off CUDA)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    for x, cache in ((k, k_cache), (v, v_cache)):
        q = quantize_kv(x, cache.kv_dtype)
        for dst, src in ((cache.data, q.data), (cache.scale, q.scale), (cache.zero, q.zero)):
            if dst is not None:
                    dst.view(-1, *dst.shape[2:])[slots] = src  # (num_blocks * block_size, Hkv, ...)


# ----------------------------------------------------------------------------------------------
# Decode attention
# ----------------------------------------------------------------------------------------------


def paged_decode_attention(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
    max_context_len: int | None = None,
    partition_size: int = 512,
) -> torch.Tensor:
    """q (S, Hq, D), one token per sequence -> (S, Hq, D) attention over its cached context.

    ``max_context_len`` (optional) spares a device sync on CUDA; ``partition_size`` is the
    flash-decoding split (a power of two >= 16).
    """
    _check_common(q, pool, layer, block_tables, context_lens, "paged_decode_attention")
    if use_triton is None:
        use_triton = q.is_cuda
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if context_lens.numel() else 0
    if use_triton:
        return _decode_triton(q, pool, layer, block_tables, context_lens, scale, max_context_len,
                              partition_size)
    return _decode_torch(q, pool, layer, block_tables, context_lens, scale, max_context_len)


def _decode_torch(q, pool, layer, block_tables, context_lens, scale, max_context_len):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = pool.num_kv_heads
    num_blocks = max(1, -(-max_context_len // pool.block_size))
    k, v = pool.gather(layer, block_tables[:, :num_blocks])  # (S, nb, B, Hkv, D) fp32
    k = k.flatten(1, 2).transpose(1, 2)  # (S, Hkv, L, D)
    v = v.flatten(1, 2).transpose(1, 2)
    # GQA without repeating K/V: the g q heads of one KV head become g "query rows" of it.
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = (positions[None, :] < context_lens[:, None].to(q.device))[:, None, None, :]  # (S, 1, 1, L)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # (S, Hkv, g, D)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _decode_triton(q, pool, layer, block_tables, context_lens, scale, max_context_len, partition_size):
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


def paged_decode_attention_reference(
    q: torch.Tensor, pool: KVPool, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, GQA by repeat_interleave, fp32."""
    out = torch.empty_like(q)
    k_all, v_all = _dequantized_layer(pool, layer)
    for i in range(q.shape[0]):
        k, v = _sequence_kv(pool, k_all, v_all, block_tables[i], int(context_lens[i]), q.shape[1])
        weights = torch.softmax(torch.einsum("hd,hld->hl", q[i].float(), k) * scale, dim=-1)
        out[i] = torch.einsum("hl,hld->hd", weights, v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Prefill attention
# ----------------------------------------------------------------------------------------------


def paged_prefill_attention(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """q (total_new, Hq, D) varlen -> (total_new, Hq, D), causal over each sequence's context.

    Sequence i's new tokens are rows ``query_start_loc[i]:query_start_loc[i + 1]`` (S + 1,) and
    are the last ``n_i`` of its ``context_lens[i]`` tokens, already written to the pool.
    """
    _check_common(q, pool, layer, block_tables, context_lens, "paged_prefill_attention")
    if query_start_loc.shape != (context_lens.shape[0] + 1,):
        raise ValueError(f"paged_prefill_attention: query_start_loc must be (S + 1,) = "
                         f"({context_lens.shape[0] + 1},), got {tuple(query_start_loc.shape)}")
    if use_triton is None:
        use_triton = q.is_cuda
    if use_triton:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        return _prefill_triton(q, pool, layer, block_tables, context_lens, query_start_loc, scale,
                               max_query_len)
    return _prefill_torch(q, pool, layer, block_tables, context_lens, query_start_loc, scale)


def _prefill_torch(q, pool, layer, block_tables, context_lens, query_start_loc, scale):
    total, num_heads, head_dim = q.shape
    num_kv_heads = pool.num_kv_heads
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        num_new = hi - lo
        if num_new == 0:
            continue
        num_blocks = -(-ctx // pool.block_size)
        k, v = pool.gather(layer, block_tables[i, :num_blocks])  # (nb, B, Hkv, D)
        k = k.flatten(0, 1)[:ctx].transpose(0, 1)  # (Hkv, ctx, D)
        v = v.flatten(0, 1)[:ctx].transpose(0, 1)
        # GQA without repeating K/V: rows (g, n) of each KV head, the causal mask repeated per g.
        qg = q[lo:hi].float().view(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(num_kv_heads, group * num_new, head_dim)
        rows = torch.arange(num_new, device=q.device) + (ctx - num_new)
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows[:, None]  # (n, ctx)
        mask = mask.repeat(group, 1)  # (g * n, ctx)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # (Hkv, g*n, D)
        out[lo:hi] = o.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(
            num_new, num_heads, head_dim).to(q.dtype)
    return out


def _prefill_triton(q, pool, layer, block_tables, context_lens, query_start_loc, scale, max_query_len,
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


def paged_prefill_attention_reference(
    q: torch.Tensor, pool: KVPool, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, explicit causal mask, fp32."""
    out = torch.empty_like(q)
    k_all, v_all = _dequantized_layer(pool, layer)
    for i in range(context_lens.shape[0]):
        lo, hi, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(context_lens[i])
        if hi == lo:
            continue
        k, v = _sequence_kv(pool, k_all, v_all, block_tables[i], ctx, q.shape[1])
        scores = torch.einsum("nhd,hld->hnl", q[lo:hi].float(), k) * scale  # (Hq, n, ctx)
        positions = torch.arange(ctx - (hi - lo), ctx)
        scores[:, torch.arange(ctx)[None, :] > positions[:, None]] = float("-inf")
        out[lo:hi] = torch.einsum("hnl,hld->nhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _dequantized_layer(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer's K and V as fp32 (num_slots, Hkv, D): references only."""
    out = []
    for c in (pool.k_caches[layer], pool.v_caches[layer]):
        x = dequantize_kv(QuantizedKV(c.kv_dtype, c.data, c.scale, c.zero))
        out.append(x.flatten(0, 1))
    return out[0], out[1]


def _sequence_kv(pool, k_all, v_all, block_table, ctx, num_heads):
    """One sequence's K, V (Hq, ctx, D), looked up slot by slot and repeated per q head."""
    slots = torch.tensor([int(block_table[t // pool.block_size]) * pool.block_size + t % pool.block_size
                          for t in range(ctx)], dtype=torch.long)
    group = num_heads // pool.num_kv_heads
    k = k_all[slots].repeat_interleave(group, dim=1).transpose(0, 1)
    v = v_all[slots].repeat_interleave(group, dim=1).transpose(0, 1)
    return k, v


def _cache_ptrs(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """data, scale, zero for a kernel; absent ones alias data (never read for that format)."""
    scale = cache.scale if cache.scale is not None else cache.data
    zero = cache.zero if cache.zero is not None else cache.data
    return cache.data, scale, zero


def _check_triton_head_dim(head_dim: int) -> None:
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton KV kernels need head_dim a power of two >= 32, got {head_dim}")


def _check_common(q, pool, layer, block_tables, context_lens, name) -> None:
    if q.dim() != 3 or q.shape[2] != pool.head_dim or q.shape[1] % pool.num_kv_heads:
        raise ValueError(f"{name}: q must be (tokens, Hq, {pool.head_dim}) with Hq a multiple of "
                         f"{pool.num_kv_heads} KV heads, got {tuple(q.shape)}")
    if not q.is_floating_point():
        raise TypeError(f"{name}: q must be floating point, got {q.dtype}")
    if q.device != pool.device:
        raise ValueError(f"{name}: q is on {q.device} but the KV pool is on {pool.device}")
    if not 0 <= layer < pool.num_layers:
        raise IndexError(f"{name}: layer {layer} out of range for {pool.num_layers} layers")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: block_tables must be a 2-D int32 tensor (S, max_blocks), "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"{name}: context_lens must be (S,) = ({block_tables.shape[0]},), "
                         f"got {tuple(context_lens.shape)}")
