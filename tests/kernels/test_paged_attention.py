"""Paged attention: the torch CPU path and the Triton kernels (interpreter here) vs the references.

Pools are filled through KVPool.write with random, off-centre K/V; block tables are shuffled and
context lengths are not multiples of the block size. Triton cases use few heads and short
contexts because the interpreter runs every program in numpy.
"""

import pytest
import torch

from kernels import cpu_ops
from kernels.kv_pool import KVPool
from kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

LAYER = 1
DTYPE_PAIRS = [("fp16", "fp16"), ("int8", "int8"), ("int4", "int4"), ("int8", "int4")]


def build(k_dtype, v_dtype, head_dim, num_kv_heads, lens, block_size=8, seed=0, use_triton=False,
          device="cpu"):
    """A 2-layer pool whose layer 1 holds len(lens) sequences; returns (pool, block_tables)."""
    gen = torch.Generator().manual_seed(seed)
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = sum(nbs) + 3  # a few blocks no sequence owns
    pool = KVPool(2, num_blocks, block_size, num_kv_heads, head_dim, k_dtype, v_dtype, device)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(lens, nbs, strict=True)):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        slots += [int(tables[i, t // block_size]) * block_size + t % block_size for t in range(n)]
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen) * 1.5 + 0.2
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen) - 0.3
    pool.write(LAYER, k.to(device), v.to(device), torch.tensor(slots, device=device), use_triton=use_triton)
    return pool, tables.to(device)


def _q(shape, seed, device="cpu"):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) + 0.1).to(device)


# ---- cache write --------------------------------------------------------------------------------


@pytest.mark.parametrize("k_dtype,v_dtype", [("fp16", "bf16"), ("int8", "int4"), ("int4", "fp32")])
def test_cache_write_kernel_matches_torch(k_dtype, v_dtype):
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(6, 2, 64, generator=gen) * 3 - 0.5
    v = torch.randn(6, 2, 64, generator=gen) + 0.7
    slots = torch.tensor([17, 3, -1, 8, 30, 0])  # out of order, one padding token
    pools = [KVPool(1, 4, 8, 2, 64, k_dtype, v_dtype) for _ in range(2)]
    pools[0].write(0, k, v, slots, use_triton=False)
    pools[1].write(0, k, v, slots, use_triton=True)
    caches = [p.k_caches + p.v_caches for p in pools]
    for a, b in zip(*caches, strict=True):
        for ta, tb in zip(a.tensors(), b.tensors(), strict=True):
            if ta.dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16; GPUs round
                torch.testing.assert_close(ta, tb, rtol=2**-7, atol=0)
            else:
                assert torch.equal(ta, tb)


# ---- decode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k_dtype,v_dtype", DTYPE_PAIRS + [("fp32", "fp32"), ("bf16", "bf16")])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("native", [True, False], ids=["cpu_ops", "torch"])
def test_decode_torch_path_matches_reference(k_dtype, v_dtype, group, head_dim, native):
    # native: plain caches go to the C++ op where it builds; otherwise the torch path runs.
    use_cpu_ops = native and cpu_ops.available()
    lens = [1, 13, 70, 33]
    pool, tables = build(k_dtype, v_dtype, head_dim, 2, lens, seed=group + head_dim)
    q = _q((len(lens), 2 * group, head_dim), seed=1)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, pool, LAYER, tables, context_lens, scale, use_cpu_ops=use_cpu_ops)
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, context_lens, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_dtype,v_dtype", [("fp32", "fp32"), ("bf16", "fp16"), ("int8", "int4")])
@pytest.mark.parametrize("length", [1, 8, 29])
def test_single_sequence_view_matches_reference(k_dtype, v_dtype, length):
    # The view is the torch path's (use_cpu_ops left off).
    # One sequence in consecutive blocks 2, 3, 4, 5 (BatchMeta.seq_view): plain caches are read
    # as a view of the pool, quantized ones gathered; both must equal the reference.
    block_size, first = 8, 2
    pool = KVPool(2, 7, block_size, 2, 64, k_dtype, v_dtype)
    gen = torch.Generator().manual_seed(length)
    k = torch.randn(length, 2, 64, generator=gen) + 0.4
    v = torch.randn(length, 2, 64, generator=gen) * 2
    pool.write(LAYER, k, v, torch.arange(first * block_size, first * block_size + length))
    tables = torch.arange(first, first + 4, dtype=torch.int32)[None]
    context_lens = torch.tensor([length], dtype=torch.int32)
    q = _q((1, 6, 64), seed=3)
    out = paged_decode_attention(q, pool, LAYER, tables, context_lens, 0.125, seq_view=(first, length))
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, context_lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_runner_marks_consecutive_blocks_only():
    from edgeinfer.worker.batch import SeqChunk, build_batch

    def view(chunks):
        return build_batch(chunks, 4, torch.device("cpu"))[1].seq_view

    assert view([SeqChunk((5,), 9, (3, 4, 5, 9))]) == (3, 10)  # positions 0..9 use blocks 3, 4, 5
    assert view([SeqChunk((5,), 9, (3, 5, 4))]) is None
    assert view([SeqChunk((5,), 9, (3, 4, 5)), SeqChunk((6,), 0, (7,))]) is None


@pytest.mark.parametrize("k_dtype,v_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 128)])
def test_decode_triton_matches_reference(k_dtype, v_dtype, group, head_dim):
    lens = [45, 1, 19]
    pool, tables = build(k_dtype, v_dtype, head_dim, 2, lens, seed=7)
    q = _q((len(lens), 2 * group, head_dim), seed=2)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, context_lens, scale)
    # partition 16 splits the long sequence into 3 partitions plus the reduce; 512 is one pass.
    for partition_size in (16, 512):
        out = paged_decode_attention(q, pool, LAYER, tables, context_lens, scale, use_triton=True,
                                     partition_size=partition_size)
        torch.testing.assert_close(out, ref, rtol=0, atol=4e-3)  # fp16 dot inputs, fp32 accumulate


# ---- prefill --------------------------------------------------------------------------------------

# (context length, new tokens): a chunk after a cached prefix, a whole prompt, one token, none.
PREFILL_SEQS = [(29, 11), (20, 20), (9, 1), (5, 0)]


def _prefill_case(k_dtype, v_dtype, head_dim, group, seed):
    lens = [ctx for ctx, _ in PREFILL_SEQS]
    pool, tables = build(k_dtype, v_dtype, head_dim, 2, lens, seed=seed)
    starts = [0]
    for _, n in PREFILL_SEQS:
        starts.append(starts[-1] + n)
    q = _q((starts[-1], 2 * group, head_dim), seed=seed + 1)
    return pool, tables, q, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)


@pytest.mark.parametrize("k_dtype,v_dtype", DTYPE_PAIRS + [("fp32", "fp32"), ("bf16", "bf16")])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_torch_path_matches_reference(k_dtype, v_dtype, group, head_dim):
    pool, tables, q, context_lens, starts = _prefill_case(k_dtype, v_dtype, head_dim, group, seed=3)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, pool, LAYER, tables, context_lens, starts, scale)
    ref = paged_prefill_attention_reference(q, pool, LAYER, tables, context_lens, starts, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_dtype,v_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 128)])
def test_prefill_triton_matches_reference(k_dtype, v_dtype, group, head_dim):
    pool, tables, q, context_lens, starts = _prefill_case(k_dtype, v_dtype, head_dim, group, seed=4)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, pool, LAYER, tables, context_lens, starts, scale, use_triton=True)
    ref = paged_prefill_attention_reference(q, pool, LAYER, tables, context_lens, starts, scale)
    torch.testing.assert_close(out, ref, rtol=0, atol=4e-3)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (20, 1.5)])
@pytest.mark.parametrize("fast", [True, False], ids=["kernels_asked", "torch"])
def test_window_and_softcap_match_reference(window, softcap, fast):
    """Sliding windows and soft-capped scores (Gemma, Mistral): decode over several sequences,
    one sequence (the view path) and prefill against the references. Asking for the Triton or
    C++ kernels, which lack both, still takes the torch path (triton is never imported here)."""
    kernels = {"use_triton": fast}
    lens = [1, 13, 70, 33]
    pool, tables = build("fp32", "fp32", 64, 2, lens, seed=9)
    q = _q((len(lens), 6, 64), seed=4) * 3  # large scores: the cap bites
    context_lens = torch.tensor(lens, dtype=torch.int32)
    extra = {"window": window, "softcap": softcap}
    out = paged_decode_attention(q, pool, LAYER, tables, context_lens, 0.125, use_cpu_ops=fast, **kernels, **extra)
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, context_lens, 0.125, **extra)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    one = paged_decode_attention(q[2:3], pool, LAYER, tables[2:3], context_lens[2:3], 0.125, **extra)
    torch.testing.assert_close(one, ref[2:3], rtol=1e-5, atol=1e-5)
    pool, tables, q, context_lens, starts = _prefill_case("fp32", "fp32", 64, 3, seed=5)
    out = paged_prefill_attention(q * 3, pool, LAYER, tables, context_lens, starts, 0.125, **kernels, **extra)
    ref = paged_prefill_attention_reference(q * 3, pool, LAYER, tables, context_lens, starts, 0.125, **extra)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_then_decode_agree_on_the_same_token():
    """The last prefill row and a decode of that token see the same context: same output."""
    pool, tables, q, context_lens, starts = _prefill_case("int8", "int4", 64, 3, seed=6)
    scale = 0.125
    prefill = paged_prefill_attention(q, pool, LAYER, tables, context_lens, starts, scale)
    last = starts[1:3] - 1  # the last new token of sequences 0 and 1
    decode = paged_decode_attention(q[last], pool, LAYER, tables[:2], context_lens[:2], scale)
    torch.testing.assert_close(decode, prefill[last], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (5, 80), (8, 48), (4, 128), (2, 256)])
def test_cpu_op_loops_match_reference(isa, dtype, group, head_dim):
    # The C++ op's AVX2 and AVX-512 inner loops, each forced: keys in blocks of 16 (the AVX-512
    # scores) with short last blocks, head groups past 4, channels past 64, a 1-token context.
    if not cpu_ops.attention_isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    lens = [1, 15, 16, 17, 70, 301]
    pool, tables = build(dtype, dtype, head_dim, 2, lens, seed=group * head_dim)
    q = _q((len(lens), 2 * group, head_dim), seed=2)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    kc, vc = pool.k_caches[LAYER].data, pool.v_caches[LAYER].data
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, context_lens, scale, isa)
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, context_lens, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


QUANT_LENS, QUANT_BLOCK, QUANT_KV_HEADS = [1, 15, 17, 45, 301], 16, 2


def _shuffled_tables(gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables for QUANT_LENS over blocks in random order, and the pool's block count."""
    per_seq = [-(-n // QUANT_BLOCK) for n in QUANT_LENS]
    blocks = sum(per_seq) + 2
    order = torch.randperm(blocks, generator=gen).int()
    tables = torch.zeros(len(QUANT_LENS), max(per_seq), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[used:used + nb]
        used += nb
    return tables, blocks


def _assert_brute_force(out, q, keys, values, tables, group, scale):
    """The oracle: each sequence's rows of the dequantized float64 caches keys / values (blocks,
    block, Hkv, D) gathered through its table, softmax attention per KV head's query heads."""
    head_dim = q.shape[-1]
    for s, n in enumerate(QUANT_LENS):
        slots = [(int(tables[s, t // QUANT_BLOCK]), t % QUANT_BLOCK) for t in range(n)]
        k = torch.stack([keys[b, i] for b, i in slots])  # (n, Hkv, D)
        v = torch.stack([values[b, i] for b, i in slots])
        qs = q[s].double().view(QUANT_KV_HEADS, group, head_dim)
        weights = (torch.einsum("hgd,thd->hgt", qs, k) * scale).softmax(-1)
        expected = torch.einsum("hgt,thd->hgd", weights, v).reshape(QUANT_KV_HEADS * group, head_dim)
        torch.testing.assert_close(out[s].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (5, 96), (1, 128), (8, 32)])
def test_cpu_op_int4_caches_match_brute_force(isa, group, head_dim):
    # int4 codes, two per byte (channel 2i in byte i's low nibble), value = code x scale + zero
    # per 32 channels; the oracle unpacks and dequantizes them in float64.
    if not cpu_ops.attention_isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    gen = torch.Generator().manual_seed(group * head_dim + 1)
    tables, blocks = _shuffled_tables(gen)
    shape = (blocks, QUANT_BLOCK, QUANT_KV_HEADS)
    codes = {name: torch.randint(0, 16, (*shape, head_dim), generator=gen, dtype=torch.uint8) for name in "kv"}
    packed = {name: c[..., 0::2] | (c[..., 1::2] << 4) for name, c in codes.items()}
    scales = {name: (torch.rand(*shape, head_dim // 32, generator=gen) * 0.2 + 0.01).half() for name in "kv"}
    zeros = {name: (torch.rand(*shape, head_dim // 32, generator=gen) * 2 - 1.5).half() for name in "kv"}
    q = _q((len(QUANT_LENS), QUANT_KV_HEADS * group, head_dim), seed=4)
    scale = head_dim**-0.5
    out = cpu_ops.paged_decode_attention(q, packed["k"], packed["v"], tables,
                                         torch.tensor(QUANT_LENS, dtype=torch.int32), scale, isa, scales["k"],
                                         scales["v"], zeros["k"], zeros["v"])
    dense = {name: (codes[name].double().view(*shape, head_dim // 32, 32) * scales[name].double()[..., None]
                    + zeros[name].double()[..., None]).view(*shape, head_dim) for name in "kv"}
    _assert_brute_force(out, q, dense["k"], dense["v"], tables, group, scale)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (5, 80), (1, 128)])
def test_cpu_op_int8_caches_match_brute_force(isa, group, head_dim):
    # int8 codes with a scale per (token, head): the scores and softmax weights carry the scales;
    # the oracle dequantizes them in float64.
    if not cpu_ops.attention_isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    gen = torch.Generator().manual_seed(group * head_dim)
    tables, blocks = _shuffled_tables(gen)
    shape = (blocks, QUANT_BLOCK, QUANT_KV_HEADS)
    k = torch.randint(-127, 128, (*shape, head_dim), generator=gen, dtype=torch.int8)
    v = torch.randint(-127, 128, (*shape, head_dim), generator=gen, dtype=torch.int8)
    k_scale = (torch.rand(*shape, generator=gen) * 0.02 + 0.005).half()
    v_scale = (torch.rand(*shape, generator=gen) * 0.02 + 0.005).half()
    q = _q((len(QUANT_LENS), QUANT_KV_HEADS * group, head_dim), seed=3)
    scale = head_dim**-0.5
    out = cpu_ops.paged_decode_attention(q, k, v, tables, torch.tensor(QUANT_LENS, dtype=torch.int32), scale, isa,
                                         k_scale, v_scale)
    _assert_brute_force(out, q, k.double() * k_scale.double()[..., None], v.double() * v_scale.double()[..., None],
                        tables, group, scale)


# Rows as a step's prompt chunks send them, a row per token with its sequence's table: a prompt
# from position 0, a chunk continuing 40 cached tokens across block edges, a decode row and a
# verify-style run of 4, so rows of one sequence are attended together in groups (of up to 9
# here: 37 rows over 4 units a thread's pair) whose last group is short.
PROMPT_ROWS = [(0, 13), (40, 19), (32, 1), (19, 4)]  # (tokens cached before, rows) per sequence


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 48)])
def test_cpu_op_prompt_rows_attend_causally(isa, dtype, group, head_dim):
    if not cpu_ops.attention_isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    totals = [cached + rows for cached, rows in PROMPT_ROWS]
    gen = torch.Generator().manual_seed(group * head_dim + len(dtype))
    pool, seq_tables = build("fp32", "fp32", head_dim, 2, totals, seed=group * head_dim)
    rows_per_seq = torch.tensor([rows for _, rows in PROMPT_ROWS])
    tables = seq_tables.repeat_interleave(rows_per_seq, dim=0).contiguous()
    lens = torch.tensor([cached + i + 1 for cached, rows in PROMPT_ROWS for i in range(rows)], dtype=torch.int32)
    q = _q((len(lens), 2 * group, head_dim), seed=5)
    scale = head_dim**-0.5
    kc, vc = pool.k_caches[LAYER].data, pool.v_caches[LAYER].data
    scales = ()
    if dtype == "int8":  # codes with a scale per (token, head); the reference reads them dequantized
        k_scale, v_scale = ((torch.rand(kc.shape[:3], generator=gen) * 0.02 + 0.005).half() for _ in "kv")
        kc, vc = (torch.randint(-127, 128, kc.shape, generator=gen, dtype=torch.int8) for _ in "kv")
        scales = (k_scale, v_scale)
        pool.k_caches[LAYER].data.copy_(kc.float() * k_scale.float()[..., None])
        pool.v_caches[LAYER].data.copy_(vc.float() * v_scale.float()[..., None])
    elif dtype == "fp16":
        kc, vc = kc.half(), vc.half()
        pool.k_caches[LAYER].data.copy_(kc.float())
        pool.v_caches[LAYER].data.copy_(vc.float())
    out = cpu_ops.paged_decode_attention(q, kc, vc, tables, lens, scale, isa, *scales)
    ref = paged_decode_attention_reference(q, pool, LAYER, tables, lens, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # An empty context among them (a row alone) attends to nothing: zeros, as without groups.
    empty = lens.clone()
    empty[13] = 0  # the continuing chunk's first row
    out_empty = cpu_ops.paged_decode_attention(q, kc, vc, tables, empty, scale, isa, *scales)
    assert torch.equal(out_empty[13], torch.zeros_like(out_empty[13]))
    keep = torch.arange(len(lens)) != 13
    torch.testing.assert_close(out_empty[keep], ref[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU ops do not build here")
def test_cpu_op_names_an_unknown_isa_and_missing_scales():
    pool, tables = build("fp16", "fp16", 64, 2, [5])
    kc, vc = pool.k_caches[LAYER].data, pool.v_caches[LAYER].data
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="unknown attention isa 'sse4'"):
        cpu_ops.paged_decode_attention(torch.randn(1, 2, 64), kc, vc, tables, lens, 1.0, "sse4")
    codes = kc.to(torch.int8)
    with pytest.raises(RuntimeError, match="int8 caches need k_scale and v_scale"):
        cpu_ops.paged_decode_attention(torch.randn(1, 2, 64), codes, codes, tables, lens, 1.0)


def test_bad_inputs_raise_clear_errors():
    pool, tables = build("fp16", "fp16", 64, 2, [5])
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(torch.randn(1, 3, 64), pool, LAYER, tables, torch.tensor([5]), 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(torch.randn(1, 2, 64), pool, LAYER, tables, torch.tensor([5, 5]), 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(torch.randn(5, 2, 64), pool, LAYER, tables, torch.tensor([5]),
                                torch.tensor([0]), 1.0)


# ---- compiled kernels (GPU only) ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("k_dtype,v_dtype", DTYPE_PAIRS + [("bf16", "bf16")])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (4, 128)])
def test_compiled_kernels_match_torch_path(k_dtype, v_dtype, group, head_dim):
    lens = [1, 700, 2051, 37]
    pool, tables = build(k_dtype, v_dtype, head_dim, 2, lens, block_size=16, seed=9, use_triton=True,
                         device="cuda")
    cpu_pool, _ = build(k_dtype, v_dtype, head_dim, 2, lens, block_size=16, seed=9)
    for a, b in zip(pool.k_caches + pool.v_caches, cpu_pool.k_caches + cpu_pool.v_caches, strict=True):
        for ta, tb in zip(a.tensors(), b.tensors(), strict=True):
            # GPU division may differ in the last bit: allow one code in a rare few.
            assert (ta.cpu().float() - tb.float()).abs().gt(1).sum() == 0
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    q = _q((len(lens), 2 * group, head_dim), seed=3, device="cuda")
    for partition_size in (64, 512):
        out = paged_decode_attention(q, pool, LAYER, tables, context_lens, scale, use_triton=True,
                                     partition_size=partition_size)
        ref = paged_decode_attention(q, pool, LAYER, tables, context_lens, scale, use_triton=False)
        torch.testing.assert_close(out, ref, rtol=0, atol=4e-3)
    news = [1, 300, 2051, 5]
    starts = torch.tensor([0] + news, device="cuda").cumsum(0).to(torch.int32)
    q = _q((sum(news), 2 * group, head_dim), seed=4, device="cuda")
    out = paged_prefill_attention(q, pool, LAYER, tables, context_lens, starts, scale, use_triton=True)
    ref = paged_prefill_attention(q, pool, LAYER, tables, context_lens, starts, scale, use_triton=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=4e-3)
