"""Decode CUDA graphs: bucket choice and padding on the CPU (the padded static-buffer path run
eagerly must give the unpadded batch's logits and write nothing for padding rows); capture and
replay against eager on a GPU (marked gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edgeinfer.config import ModelConfig, RuntimeConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.synthetic import synthetic_model
from edgeinfer.worker.batch import SeqChunk, build_batch
from edgeinfer.worker.cuda_graphs import PAD_SLOT, DecodeGraphs, pad_decode_batch, select_bucket
from edgeinfer.worker.model_runner import ModelRunner
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, max_position=256)
BLOCK = 4


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    loaded = synthetic_model(TINY, "int4", group_size=32, seed=1)
    return LlamaModel(loaded.config, loaded.weights, choose_backend("reference"))


def make_pool(model: LlamaModel, num_blocks: int = 16, kv_dtype: str = "fp32") -> KVPool:
    c = model.config
    return KVPool(c.num_layers, num_blocks, BLOCK, c.num_kv_heads, c.head_dim, kv_dtype, kv_dtype, model.device)


def test_select_bucket() -> None:
    sizes = (1, 2, 4, 8, 16, 32)
    assert [select_bucket(n, sizes) for n in (1, 2, 3, 4, 5, 9, 17, 32)] == [1, 2, 4, 4, 8, 16, 32, 32]
    assert select_bucket(33, sizes) is None
    assert select_bucket(3, (8, 2)) == 8  # order does not matter
    with pytest.raises(ValueError, match="at least one"):
        select_bucket(0, sizes)


def test_pad_decode_batch_exact() -> None:
    chunks = [SeqChunk((7,), 5, (3, 9)), SeqChunk((11,), 0, (4,))]
    inputs = pad_decode_batch(chunks, bucket=4, max_blocks=3, block_size=BLOCK)
    assert inputs.num_seqs == 2
    assert inputs.token_ids.tolist() == [7, 11, 0, 0]
    assert inputs.positions.tolist() == [5, 0, 0, 0]
    assert inputs.slot_mapping.tolist() == [9 * BLOCK + 1, 4 * BLOCK, PAD_SLOT, PAD_SLOT]
    assert inputs.block_tables.tolist() == [[3, 9, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert inputs.context_lens.tolist() == [6, 1, 1, 1]
    with pytest.raises(ValueError, match="exceeds"):
        pad_decode_batch([SeqChunk((1,), 0, (1, 2, 3, 4))], 1, 3, BLOCK)
    with pytest.raises(ValueError, match="one new token"):
        pad_decode_batch([SeqChunk((1, 2), 0, (1,))], 1, 3, BLOCK)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_batch(chunks, 1, 3, BLOCK)


def test_fits(tiny_model: LlamaModel) -> None:
    graphs = DecodeGraphs(tiny_model, make_pool(tiny_model), BLOCK, (1, 2, 4), max_blocks=3, use_graphs=False)
    assert graphs.fits([SeqChunk((1,), 0, (0,))] * 4)
    assert not graphs.fits([SeqChunk((1,), 0, (0,))] * 5)  # past the largest bucket
    assert not graphs.fits([SeqChunk((1, 2), 0, (0,))])  # prefill
    assert not graphs.fits([SeqChunk((1,), 0, (0, 1, 2, 3))])  # table longer than max_blocks
    assert not graphs.fits([])


def prefill(runner: ModelRunner, prompts: list[list[int]], tables: list[tuple[int, ...]]) -> None:
    runner.logits([SeqChunk(tuple(p), 0, t) for p, t in zip(prompts, tables, strict=True)])


@pytest.mark.parametrize("num_seqs", [1, 2])
def test_a_context_bound_gives_the_exact_logits(tiny_model: LlamaModel, num_seqs: int) -> None:
    """Graphs pass the table capacity as max_context_len instead of the true longest context."""
    pool = make_pool(tiny_model)
    runner = ModelRunner(tiny_model, pool, BLOCK)
    tables = [(0, 1, 2), (3, 4)][:num_seqs]
    prefill(runner, [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]][:num_seqs], tables)
    step = [SeqChunk((10,), 7, tables[0]), SeqChunk((11,), 3, (3, 4))][:num_seqs]
    token_ids, meta = build_batch(step, BLOCK, tiny_model.device)
    expected = tiny_model.forward(token_ids, meta, pool)
    bounded = dataclasses.replace(meta, max_context_len=12 * BLOCK)  # rewrites the same K/V bytes
    torch.testing.assert_close(tiny_model.forward(token_ids, bounded, pool), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_padded_batch_gives_unpadded_logits_and_writes_nothing_for_padding(tiny_model: LlamaModel,
                                                                          kv_dtype: str) -> None:
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5, 5, 5, 5, 5]]
    tables = [(0, 1, 2), (3, 4), (6, 7)]
    step = [SeqChunk((10,), 7, tables[0]), SeqChunk((11,), 3, tables[1]), SeqChunk((12,), 5, tables[2])]

    plain_pool = make_pool(tiny_model, kv_dtype=kv_dtype)
    plain = ModelRunner(tiny_model, plain_pool, BLOCK)
    prefill(plain, prompts, tables)
    expected = plain.logits(step)  # eager, unpadded, 3 rows

    padded_pool = make_pool(tiny_model, kv_dtype=kv_dtype)
    prefill(ModelRunner(tiny_model, padded_pool, BLOCK), prompts, tables)
    graphs = DecodeGraphs(tiny_model, padded_pool, BLOCK, (1, 2, 4, 8), max_blocks=5, use_graphs=False)
    got = graphs.run(step)  # bucket 4: one padding row
    assert got.shape == expected.shape == (3, TINY.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    unused = [b for b in range(16) if not any(b in t for t in tables)]  # 0, 5, 8..15
    for a, b in zip(plain_pool.k_caches + plain_pool.v_caches, padded_pool.k_caches + padded_pool.v_caches,
                    strict=True):
        for ta, tb in zip(a.tensors(), b.tensors(), strict=True):
            # The real rows' K/V agree (a GEMM of 4 rows may round unlike one of 3; int8 codes by 1) ...
            torch.testing.assert_close(ta.float(), tb.float(), rtol=1e-5, atol=1 if kv_dtype == "int8" else 1e-5)
            # ... and padding wrote nothing: blocks no table names are still all zero.
            assert not tb[unused].any()

    # A second, smaller step reuses the same static buffers (bucket 1): stale rows must not leak.
    one = [SeqChunk((13,), 8, tables[0])]
    torch.testing.assert_close(graphs.run(one), plain.logits(one), rtol=1e-5, atol=1e-5)


def test_runner_on_cpu_ignores_graph_sizes(tiny_model: LlamaModel) -> None:
    runner = ModelRunner(tiny_model, make_pool(tiny_model), BLOCK, graph_batch_sizes=(1, 2))
    assert runner.graphs is None
    runner.capture_graphs()  # no-op
    assert runner.logits([SeqChunk((1, 2), 0, (0,))]).shape == (1, TINY.vocab_size)
    with pytest.raises(ValueError, match="CUDA graphs need a model on CUDA"):
        DecodeGraphs(tiny_model, make_pool(tiny_model), BLOCK, (1,), max_blocks=2)


def test_runtime_config_graph_fields() -> None:
    rt = RuntimeConfig(cuda_graphs=True, graph_batch_sizes=[1, 4])  # a list is taken as a tuple
    assert rt.graph_batch_sizes == (1, 4) and rt.cuda_graphs
    assert RuntimeConfig().graph_batch_sizes == (1, 2, 4, 8, 16, 32) and not RuntimeConfig().cuda_graphs
    for bad in ((), (0,), (2, -1)):
        with pytest.raises(ValueError, match="graph_batch_sizes"):
            RuntimeConfig(graph_batch_sizes=bad)


# ---- GPU: capture and replay ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_graph_replay_matches_eager_on_cuda(weights: str) -> None:
    loaded = synthetic_model("135m", weights, seed=2, device="cuda", max_position=1024)
    model = LlamaModel(loaded.config, loaded.weights, choose_backend("triton", "cuda"))
    c = model.config
    pools = [KVPool(c.num_layers, 64, 16, c.num_kv_heads, c.head_dim, "fp16", "fp16", "cuda") for _ in range(2)]
    eager = ModelRunner(model, pools[0], 16)
    graphed = ModelRunner(model, pools[1], 16, graph_batch_sizes=(1, 2, 4, 8), max_blocks_per_seq=8)
    assert graphed.graphs is not None
    prompts = [list(range(1 + i, 40 + 7 * i)) for i in range(5)]
    tables = [tuple(range(8 * i, 8 * i + 8)) for i in range(5)]
    for runner in (eager, graphed):
        prefill(runner, prompts, tables)
    tokens = [[p[-1]] for p in prompts]
    for step in range(6):  # 5 sequences: bucket 8, padded; then 3 sequences: bucket 4
        live = range(5) if step < 3 else range(3)
        chunks = [SeqChunk((tokens[i][-1],), len(prompts[i]) + step, tables[i]) for i in live]
        want = eager.logits(chunks)
        got = graphed.logits(chunks)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        for i, t in zip(live, want.argmax(-1).tolist(), strict=True):
            tokens[i].append(t)
    assert set(graphed.graphs._graphs) == {1, 2, 4, 8}
