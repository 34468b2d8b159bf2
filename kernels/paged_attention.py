"""Attention over the paged, quantized KV pool: decode and chunked-prefill attention.

Entry points (one dispatch each, by argument from the caller's kernels.dispatch.Backend:
``use_triton`` runs Triton, on CUDA or under TRITON_INTERPRET=1; ``use_cpu_ops`` runs decode over
plain caches through kernels.cpu_ops' C++ op, which the torch path is the reference for;
otherwise the vectorised torch path):

- (writing the cache, KVPool.write: kernels.kv_pool.write_kv_cache_reference, or the Triton
  write_kv_cache with ``use_triton``) quantizes new K/V (T, Hkv, D) and scatters them into slots.
- ``paged_decode_attention``: one query token per sequence, q (S, Hq, D).
- ``paged_prefill_attention``: varlen new tokens q (total, Hq, D), sequence i's rows are
  ``query_start_loc[i]:query_start_loc[i + 1]`` and sit at the end of its context, causal.

Conventions shared by all: the new tokens' K/V are written to the pool *before* attention, so
``context_lens`` (S,) counts them (decode and prefill read the same quantized bytes);
``block_tables`` (S, max_blocks) int32 maps logical block j of sequence i to a pool block;
q head h reads KV head ``h // (Hq // Hkv)`` (GQA, as HF's repeat_kv). Outputs have q's dtype.
``window`` W (sliding-window layers): a query at position p reads keys p - W + 1 .. p only;
``softcap`` c: scores become c * tanh(scores / c) before the mask (Gemma 2). The Triton and
C++ kernels implement neither, so either takes the torch path (the model says so once).

Online softmax invariant (both kernels): after each K/V tile, for every query row, ``m`` is the
running max of its scores (log2 domain: q is pre-scaled by ``scale * log2(e)``), ``l`` the sum
of ``exp2(score - m)`` and ``acc`` the matching weighted sum of V, all in fp32; a new tile
rescales both by ``exp2(m_old - m_new)``. Flash-decoding splits a sequence into partitions of
``partition_size`` tokens that each keep (m, l, acc); the reduce kernel merges them, so a single
long sequence still fills the GPU. The kernels work on even and odd channels as two halves,
which is how int4 stores them (low / high nibble), so every format shares one code path.

The Triton kernels live in kernels.paged_attention_triton, imported only when used, so the CPU
path never loads triton (~70 MB of RSS). They assume the pool's contiguous layout
(kernels.kv_pool), so a (token, KV head) row
index ``slot * Hkv + head`` locates data, scale and zero alike. This module holds no state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.kv_quant import dequantize_kv

if TYPE_CHECKING:
    from kernels.kv_pool import KVPool


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
    use_triton: bool = False,
    use_cpu_ops: bool = False,
    max_context_len: int | None = None,
    partition_size: int = 512,
    seq_view: tuple[int, int] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (S, Hq, D), one token per sequence -> (S, Hq, D) attention over its cached context.

    ``max_context_len`` (optional) is an upper bound on ``context_lens`` (exact or not: blocks past
    a row's length are masked or skipped); it spares a device sync on CUDA; ``partition_size`` is the
    flash-decoding split (a power of two >= 16). ``seq_view`` (first block, length): S is 1 and
    the sequence's blocks are consecutive from that block, so the torch path reads plain caches
    as a view (BatchMeta.seq_view).
    """
    _check_common(q, pool, layer, block_tables, context_lens, "paged_decode_attention")
    if window is not None or softcap is not None:
        return _decode_torch(q, pool, layer, block_tables, context_lens, scale, max_context_len, seq_view,
                             window, softcap)
    if use_triton:
        if max_context_len is None:
            max_context_len = int(context_lens.max()) if context_lens.numel() else 0
        from kernels.paged_attention_triton import decode_triton

        return decode_triton(q, pool, layer, block_tables, context_lens, scale, max_context_len,
                              partition_size)
    kc, vc = pool.k_caches[layer], pool.v_caches[layer]
    if use_cpu_ops and kc.scale is None and vc.scale is None and kc.data.dtype == vc.data.dtype and \
            q.shape[-1] % 8 == 0:
        out = cpu_ops.paged_decode_attention(q, kc.data, vc.data, block_tables.int(), context_lens.int(), scale)
        return out.to(q.dtype)
    return _decode_torch(q, pool, layer, block_tables, context_lens, scale, max_context_len, seq_view)


def _decode_torch(q, pool, layer, block_tables, context_lens, scale, max_context_len, seq_view,
                  window=None, softcap=None):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = pool.num_kv_heads
    # GQA without repeating K/V: the g q heads of one KV head become g "query rows" of it.
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if num_seqs == 1 and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        # (Its length read syncs, which a CUDA graph capture cannot: windowed and soft-capped
        # layers run here on CUDA, the Triton kernels lacking both.)
        # The single-stream hot path (runs 30x per token): no padding mask, so K/V are cut to the
        # exact length, and plain caches are read straight from the pool. max_context_len may
        # be only a bound, so the length comes from context_lens.
        kc, vc = pool.k_caches[layer], pool.v_caches[layer]
        plain = kc.scale is None and vc.scale is None
        if plain and seq_view is not None:  # a view, no gather: 84 vs 122 us at L=300, 3 KV heads
            first, length = seq_view
            start = first * pool.block_size
            k, v = (c.data.flatten(0, 1)[start:start + length].float() for c in (kc, vc))
        else:
            length = int(context_lens[0])
            ids = block_tables[0, : -(-length // pool.block_size)]
            if plain:
                k, v = (c.data.index_select(0, ids).flatten(0, 1)[:length].float() for c in (kc, vc))
            else:
                k, v = (x.flatten(0, 1)[:length] for x in pool.gather(layer, ids))
        if window is not None:  # the query sits at the last position
            k, v = k[-window:], v[-window:]
        # Two bmm's beat CPU SDPA's flash kernel at one query row per head (59 vs 100 us, L=300).
        scores = _softcapped(torch.bmm(qg[0] * scale, k.permute(1, 2, 0)), softcap)  # (Hkv, g, L)
        out = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))  # (Hkv, g, D)
        return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    num_blocks = max(1, -(-max_context_len // pool.block_size))
    k, v = pool.gather(layer, block_tables[:, :num_blocks])  # (S, nb, B, Hkv, D) fp32
    k = k.flatten(1, 2).transpose(1, 2)  # (S, Hkv, L, D)
    v = v.flatten(1, 2).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=q.device)
    lens = context_lens[:, None].to(q.device)
    mask = positions[None, :] < lens
    if window is not None:
        mask &= positions[None, :] >= lens - window
    out = _attend(qg, k, v, mask[:, None, None, :], scale, softcap)  # mask (S, 1, 1, L) -> (S, Hkv, g, D)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_decode_attention_reference(
    q: torch.Tensor, pool: KVPool, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, GQA by repeat_interleave, fp32."""
    out = torch.empty_like(q)
    k_all, v_all = _dequantized_layer(pool, layer)
    for i in range(q.shape[0]):
        ctx = int(context_lens[i])
        k, v = _sequence_kv(pool, k_all, v_all, block_tables[i], ctx, q.shape[1])
        scores = _softcapped(torch.einsum("hd,hld->hl", q[i].float(), k) * scale, softcap)
        if window is not None:
            scores[:, : max(0, ctx - window)] = float("-inf")
        weights = torch.softmax(scores, dim=-1)
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
    use_triton: bool = False,
    max_query_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (total_new, Hq, D) varlen -> (total_new, Hq, D), causal over each sequence's context.

    Sequence i's new tokens are rows ``query_start_loc[i]:query_start_loc[i + 1]`` (S + 1,) and
    are the last ``n_i`` of its ``context_lens[i]`` tokens, already written to the pool.
    """
    _check_common(q, pool, layer, block_tables, context_lens, "paged_prefill_attention")
    if query_start_loc.shape != (context_lens.shape[0] + 1,):
        raise ValueError(f"paged_prefill_attention: query_start_loc must be (S + 1,) = "
                         f"({context_lens.shape[0] + 1},), got {tuple(query_start_loc.shape)}")
    if use_triton and window is None and softcap is None:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        from kernels.paged_attention_triton import prefill_triton

        return prefill_triton(q, pool, layer, block_tables, context_lens, query_start_loc, scale,
                               max_query_len)
    return _prefill_torch(q, pool, layer, block_tables, context_lens, query_start_loc, scale, window, softcap)


def _prefill_torch(q, pool, layer, block_tables, context_lens, query_start_loc, scale, window=None, softcap=None):
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
        keys = torch.arange(ctx, device=q.device)[None, :]
        mask = keys <= rows[:, None]  # (n, ctx)
        if window is not None:
            mask &= keys > rows[:, None] - window
        mask = mask.repeat(group, 1)  # (g * n, ctx)
        o = _attend(qg, k, v, mask, scale, softcap)  # (Hkv, g*n, D)
        out[lo:hi] = o.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(
            num_new, num_heads, head_dim).to(q.dtype)
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor, pool: KVPool, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, explicit causal mask, fp32."""
    out = torch.empty_like(q)
    k_all, v_all = _dequantized_layer(pool, layer)
    for i in range(context_lens.shape[0]):
        lo, hi, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(context_lens[i])
        if hi == lo:
            continue
        k, v = _sequence_kv(pool, k_all, v_all, block_tables[i], ctx, q.shape[1])
        scores = _softcapped(torch.einsum("nhd,hld->hnl", q[lo:hi].float(), k) * scale, softcap)  # (Hq, n, ctx)
        positions = torch.arange(ctx - (hi - lo), ctx)
        masked = torch.arange(ctx)[None, :] > positions[:, None]
        if window is not None:
            masked |= torch.arange(ctx)[None, :] <= positions[:, None] - window
        scores[:, masked] = float("-inf")
        out[lo:hi] = torch.einsum("hnl,hld->nhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _attend(q, k, v, mask, scale, softcap):
    """SDPA with a boolean mask (True: attend), or its explicit form where scores are soft-capped."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = _softcapped(q @ k.transpose(-1, -2) * scale, softcap).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _dequantized_layer(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer's K and V as fp32 (num_slots, Hkv, D): references only."""
    out = []
    for c in (pool.k_caches[layer], pool.v_caches[layer]):
        x = dequantize_kv(c)
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
