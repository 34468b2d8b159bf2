"""The CUDA engine against the CPU fp32 path (all marked gpu: skipped without a CUDA GPU).

- Greedy tokens on CUDA (Triton GEMMs, fp16 KV, decode CUDA graphs) equal the CPU fp32
  reference path's for the first 16 tokens, on the few-layer slice of the default model
  (tools/make_slice.py; travels to the GPU machine as build/gpu/slice) and on a synthetic
  135M-shaped model.
- Batch invariance on CUDA: concurrent requests through the Engine give the tokens each gets alone.

fp16 activations can legitimately flip a near-tie, so where tokens differ the first difference
must be one: the CPU fp32 logits of the two candidate tokens within GPU_NEAR_TIE.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
import torch
from fake_runner import greedy_alone

from edgeinfer.config import SchedulerConfig
from edgeinfer.core.events import Finished, Token
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.engine.api import Engine
from edgeinfer.models.llama import LlamaModel
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
NUM_TOKENS = 16
GPU_NEAR_TIE = 0.05  # fp32 logit gap under which fp16 rounding may pick the other token
GRAPH_SIZES = (1, 2, 4, 8, 16, 32)
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
         "The quick brown fox jumps over the lazy dog. The quick brown fox", "Q: What is 2 + 2?\nA:"]


@pytest.fixture(scope="module")
def sliced():  # noqa: ANN201
    from edgeinfer.models.loader import load_model

    path = Path(os.environ.get("EDGEINFER_SLICE", ROOT / "build" / "gpu" / "slice"))
    if not (path / "config.json").is_file():
        pytest.skip(f"no model slice at {path}: run tools/make_slice.py and carry build/gpu")
    return load_model(path)


@pytest.fixture(scope="module")
def synthetic():  # noqa: ANN201
    from edgeinfer.models.synthetic import synthetic_model

    return synthetic_model("135m", "int4", seed=5, max_position=512)


def cpu_model(loaded) -> LlamaModel:  # noqa: ANN001
    return LlamaModel(loaded.config, loaded.weights, choose_backend("reference", "cpu"))


def cuda_model(loaded) -> LlamaModel:  # noqa: ANN001
    return LlamaModel(loaded.config, loaded.weights, choose_backend("triton", "cuda"))


def make_runner(model: LlamaModel, num_blocks: int, graphs: bool = True) -> ModelRunner:
    c = model.config
    kv = "fp16" if model.device.type == "cuda" else "fp32"
    pool = KVPool(c.num_layers, num_blocks, 16, c.num_kv_heads, c.head_dim, kv, kv, model.device)
    return ModelRunner(model, pool, 16, graph_batch_sizes=GRAPH_SIZES if graphs else ())


def greedy(model: LlamaModel, prompt_ids: list[int], graphs: bool = True) -> list[int]:
    runner = make_runner(model, -(-(len(prompt_ids) + NUM_TOKENS) // 16), graphs)
    return greedy_alone(runner, prompt_ids, NUM_TOKENS)


def logit_gap(cpu: LlamaModel, context: list[int], a: int, b: int) -> float:
    """|fp32 logit of a - of b| after ``context`` (the CPU oracle)."""
    runner = make_runner(cpu, -(-len(context) // 16))
    logits = runner.logits([SeqChunk(tuple(context), 0, tuple(range(runner.pool.num_blocks)))])[0]
    return abs(float(logits[a] - logits[b]))


def assert_same_or_near_tie(cpu: LlamaModel, prompt_ids: list[int], got: list[int], want: list[int],
                            what: str) -> None:
    assert len(got) == len(want) == NUM_TOKENS, what
    if got == want:
        return
    j = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    gap = logit_gap(cpu, [*prompt_ids, *want[:j]], got[j], want[j])
    assert gap < GPU_NEAR_TIE, f"{what}: token {j} is {got[j]} on CUDA, {want[j]} on the CPU; fp32 gap {gap:.4f}"


def prompts_of(loaded) -> list[list[int]]:  # noqa: ANN001
    if loaded.tokenizer is not None:
        return [loaded.tokenizer.encode(t) for t in TEXTS]
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40, 100)]


@pytest.mark.parametrize("which", ["sliced", "synthetic"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_greedy_matches_cpu_fp32(request: pytest.FixtureRequest, which: str, graphs: bool) -> None:
    loaded = request.getfixturevalue(which)
    cpu, gpu = cpu_model(loaded), cuda_model(loaded)
    for i, prompt_ids in enumerate(prompts_of(loaded)):
        want = greedy(cpu, prompt_ids)
        got = greedy(gpu, prompt_ids, graphs)
        assert_same_or_near_tie(cpu, prompt_ids, got, want, f"{which} prompt {i}")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _generate(engine: Engine, reqs: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}

    async def one(rid: str, prompt_ids: list[int]) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        events = [e async for e in engine.generate(GenerateRequest(rid, prompt_token_ids=tuple(prompt_ids),
                                                                    params=params))]
        assert isinstance(events[-1], Finished), events[-1]
        out[rid] = [t for e in events if isinstance(e, Token) for t in e.token_ids]

    async with anyio.create_task_group() as tg:
        for rid, prompt_ids in reqs:
            tg.start_soon(one, rid, prompt_ids)
    return out


@pytest.mark.anyio
async def test_cuda_engine_batch_invariance(sliced) -> None:  # noqa: ANN001
    """12 concurrent requests (decode batches padded into graph buckets) vs each alone."""
    gpu, cpu = cuda_model(sliced), cpu_model(sliced)
    prompts = [prompts_of(sliced)[i % len(TEXTS)] * (1 + i % 3) for i in range(12)]
    reqs = [(f"r{i}", p) for i, p in enumerate(prompts)]
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_watermark=0.0)
    with anyio.fail_after(300):
        async with Engine.from_runner(make_runner(gpu, 256), sliced.tokenizer, sliced.config, config) as engine:
            batched = await _generate(engine, reqs)
        async with Engine.from_runner(make_runner(gpu, 256), sliced.tokenizer, sliced.config, config) as engine:
            for rid, prompt_ids in reqs:
                alone = (await _generate(engine, [(rid, prompt_ids)]))[rid]
                assert_same_or_near_tie(cpu, prompt_ids, batched[rid], alone, f"{rid} batched vs alone")
