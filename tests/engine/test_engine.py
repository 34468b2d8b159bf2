"""End-to-end Engine tests on the real default model, fp32 reference path (exact numerics).

Batched greedy decoding must give each request the tokens it gets alone; where a token differs,
the first difference must be a near-tie of the alone run (top-2 logit gap < 1e-3), which batch
shape can legitimately flip. Small pools force preemption. Every test runs under a timeout.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from edgeinfer.config import CPU_STEP_TOKENS, SchedulerConfig
from edgeinfer.core.events import OVERLOADED, PROMPT_TOO_LONG, Accepted, Error, Finished, Token
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.engine.api import Engine
from edgeinfer.models.llama import LlamaModel
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from kernels import cpu_a8, cpu_ops
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool

pytestmark = pytest.mark.anyio
NEAR_TIE = 1e-3
TIMEOUT_S = 170  # generous: the CPU is shared; a hang still fails


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(loaded_model):  # noqa: ANN001, ANN201
    return LlamaModel(loaded_model.config, loaded_model.weights, choose_backend("reference"))


def make_engine(loaded, model: LlamaModel, num_blocks: int, **scheduler) -> Engine:  # noqa: ANN001, ANN003
    c = loaded.config
    pool = KVPool(c.num_layers, num_blocks, 16, c.num_kv_heads, c.head_dim, "fp32", "fp32", "cpu")
    cfg = SchedulerConfig(**{"kv_watermark": 0.0, **scheduler})
    return Engine.from_runner(ModelRunner(model, pool, 16), loaded.tokenizer, c, cfg)


TEXTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox", "Water boils at",
    "In machine learning, a transformer is a model that", "Hello! My name is", "The sky is blue because",
    "Roses are red, violets are", "import numpy as np\nx = np.", "The largest planet in the solar system",
    "Q: What is 2 + 2?\nA:", "Paris, London, Berlin,", "A haiku about autumn:\n", "SELECT * FROM",
]


def requests(n: int, tokenizer) -> list[tuple[str, tuple[int, ...], int]]:  # noqa: ANN001
    """n requests of mixed prompt lengths (a text repeated 1-3 times) and 3-8 new tokens."""
    out = []
    for i in range(n):
        text = " ".join([TEXTS[i % len(TEXTS)]] * (1 + i % 3))
        out.append((f"r{i}", tuple(tokenizer.encode(text)), 3 + (i * 5) % 6))
    return out


async def generate_all(engine: Engine, reqs) -> dict[str, list]:  # noqa: ANN001
    events: dict[str, list] = {}

    async def one(rid: str, prompt_ids: tuple[int, ...], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        events[rid] = [e async for e in engine.generate(GenerateRequest(rid, prompt_token_ids=prompt_ids,
                                                                          params=params))]

    async with anyio.create_task_group() as tg:
        for req in reqs:
            tg.start_soon(one, *req)
    return events


def tokens_of(events: list) -> list[int]:
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Token) for t in e.token_ids]


def top2_gap(model: LlamaModel, loaded, context: list[int]) -> float:  # noqa: ANN001
    c = loaded.config
    blocks = -(-len(context) // 16)
    pool = KVPool(c.num_layers, blocks, 16, c.num_kv_heads, c.head_dim, "fp32", "fp32", "cpu")
    logits = ModelRunner(model, pool, 16).logits([SeqChunk(tuple(context), 0, tuple(range(blocks)))])
    top = logits[0].topk(2).values
    return float(top[0] - top[1])


async def check_same_as_alone(loaded, model, batched: dict[str, list], reqs) -> None:  # noqa: ANN001
    alone_engine = make_engine(loaded, model, 64)
    async with alone_engine:
        for rid, prompt_ids, max_tokens in reqs:
            alone = tokens_of((await generate_all(alone_engine, [(rid, prompt_ids, max_tokens)]))[rid])
            got = tokens_of(batched[rid])
            assert len(got) == len(alone) == max_tokens
            if got != alone:
                j = next(k for k, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b)
                gap = top2_gap(model, loaded, [*prompt_ids, *alone[:j]])
                assert gap < NEAR_TIE, f"{rid}: token {j} differs ({got[j]} vs {alone[j]}), top-2 gap {gap}"


async def concurrent_matches_alone(loaded, model, n: int, token_budget: int | None = 256) -> None:  # noqa: ANN001
    """``token_budget`` None: the engine's default for the CPU."""
    reqs = requests(n, loaded.tokenizer)
    engine = make_engine(loaded, model, 64, max_num_seqs=n, max_num_batched_tokens=token_budget)
    with anyio.fail_after(TIMEOUT_S):
        async with engine:
            if token_budget is None:
                assert engine._scheduler_actor.scheduler.config.max_num_batched_tokens == CPU_STEP_TOKENS
            batched = await generate_all(engine, reqs)
            stats = engine.stats()
            assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
            bm = engine._scheduler_actor.scheduler.block_manager
            bm.check_invariants()
            assert bm.num_free + bm.num_cached == bm.num_blocks
        await check_same_as_alone(loaded, model, batched, reqs)


async def test_32_concurrent_greedy_match_alone(loaded_model, model) -> None:  # noqa: ANN001
    await concurrent_matches_alone(loaded_model, model, 32)


@pytest.mark.skipif(not cpu_ops.available() or not cpu_a8.isa_supported(cpu_a8.BF16_ISA),
                    reason="this CPU has no AMX-BF16")
async def test_concurrent_greedy_match_alone_with_bf16_prompts(loaded_model) -> None:  # noqa: ANN001
    """cpu_activations bf16-prompts (auto on AMX-BF16 CPUs): prompt rows in bf16, generated rows
    in int8x2, in steps that mix both; each request's tokens as alone, at the engine's CPU step
    budget, which is the fused step's bound: a longer step attends in another order (the per-op
    forward), whose last-bit differences bf16's coarser rounding turns into near ties at its own
    scale (16 requests at a 256-token budget: one differed, top-2 gap 0.0055)."""
    backend = choose_backend("int4_cpu", "cpu", int8_activations=True, a8_terms=2, a8_bf16_prompts=True)
    assert CPU_STEP_TOKENS <= backend.fused_step_max_tokens
    model = LlamaModel(loaded_model.config, loaded_model.weights, backend)
    await concurrent_matches_alone(loaded_model, model, 16, token_budget=None)


async def test_small_pool_preempts_and_resumes(loaded_model, model) -> None:  # noqa: ANN001
    # Two 30-token prompts (2 blocks each) with 8 new tokens (3 blocks for life) in a 5-block
    # pool: both are admitted, both need a third block at token 33, so the newer is preempted,
    # recomputed once the older finishes, and must still give its alone tokens.
    tok = loaded_model.tokenizer
    reqs = []
    for i, text in enumerate(("The history of the city of Rome", "A short guide to baking bread")):
        ids = tok.encode((text + ": ") * 8)[:30]
        reqs.append((f"p{i}", tuple(ids), 8))
    engine = make_engine(loaded_model, model, 5, max_num_seqs=4, max_num_batched_tokens=64)
    with anyio.fail_after(TIMEOUT_S):
        async with engine:
            batched = await generate_all(engine, reqs)
            assert engine.stats().num_preemptions >= 1
            assert engine.stats().kv_blocks_used == 0
        await check_same_as_alone(loaded_model, model, batched, reqs)


async def test_admission_errors_and_cancel(loaded_model, model) -> None:  # noqa: ANN001
    engine = make_engine(loaded_model, model, 4, max_num_seqs=1, max_num_batched_tokens=64, max_waiting=1)
    with anyio.fail_after(TIMEOUT_S):
        async with engine:
            long_ids = tuple(range(100, 170))  # 70 tokens: more than the whole 64-slot pool
            events = [e async for e in engine.generate(GenerateRequest("long", prompt_token_ids=long_ids))]
            assert [type(e) for e in events] == [Error] and events[0].code == PROMPT_TOO_LONG

            first = engine.generate(GenerateRequest("first", prompt="Tell me a story",
                                                    params=SamplingParams(temperature=0.0, max_tokens=50)))
            assert isinstance(await first.__anext__(), Accepted)
            assert isinstance(await first.__anext__(), Token)  # running: the only batch slot taken
            chat = GenerateRequest("chat", messages=({"role": "user", "content": "Hi"},),
                                   params=SamplingParams(temperature=0.0, max_tokens=3))
            second = engine.generate(chat)
            assert isinstance(await second.__anext__(), Accepted)  # waits behind "first"
            third = [e async for e in engine.generate(GenerateRequest("third", prompt="x"))]
            assert third[0].code == OVERLOADED and third[0].retry_after_s is not None

            await first.aclose()  # cancel mid-stream: "first" frees its blocks, "chat" runs
            rest = [e async for e in second]
            assert isinstance(rest[-1], Finished) and rest[-1].usage.completion_tokens == 3
            assert engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0


def test_greedy_alone_is_deterministic_reference(loaded_model, model) -> None:  # noqa: ANN001
    """The near-tie measure itself: a clear token has a large gap."""
    ids = loaded_model.tokenizer.encode("The capital of France is")
    assert top2_gap(model, loaded_model, ids) > NEAR_TIE
    assert torch.get_default_dtype() == torch.float32


async def test_shared_prefix_reuses_blocks_and_gives_the_same_tokens(loaded_model, model) -> None:  # noqa: ANN001
    """A second request sharing a 3-block prefix hits the prefix cache and still decodes exactly
    as a fresh engine (no cache) does."""
    tok = loaded_model.tokenizer
    prefix = tok.encode("You are a careful assistant. Answer in one short sentence, plainly. " * 4)
    assert len(prefix) >= 48
    reqs = [("a", tuple(prefix + tok.encode(" What is the capital of France?")), 8),
            ("b", tuple(prefix + tok.encode(" What colour is the sky?")), 8)]
    with anyio.fail_after(TIMEOUT_S):
        async with make_engine(loaded_model, model, 32) as engine:
            await generate_all(engine, reqs[:1])
            second = await generate_all(engine, reqs[1:])
        async with make_engine(loaded_model, model, 32) as fresh:
            expected = await generate_all(fresh, reqs[1:])
    usage = second["b"][-1].usage
    assert usage.cached_prompt_tokens >= 48, usage
    assert expected["b"][-1].usage.cached_prompt_tokens == 0
    assert tokens_of(second["b"]) == tokens_of(expected["b"])


async def test_n_choices_end_to_end(loaded_model, model) -> None:  # noqa: ANN001
    """n = 3 seeded choices from one request: choice 0 is the seeded n = 1 answer, the choices
    differ, and the request ends once with every choice listed."""
    engine = make_engine(loaded_model, model, 64)
    prompt = tuple(loaded_model.tokenizer.encode("Once upon a time"))

    async def run(n: int) -> list:
        params = SamplingParams(temperature=1.2, seed=3, n=n, max_tokens=6, ignore_eos=True)
        return [e async for e in engine.generate(GenerateRequest(f"n{n}", prompt_token_ids=prompt, params=params))]

    with anyio.fail_after(TIMEOUT_S):
        async with engine:
            three, one = await run(3), await run(1)
    per_choice = [[t for e in three if isinstance(e, Token) and e.index == i for t in e.token_ids] for i in range(3)]
    assert per_choice[0] == tokens_of(one)
    assert all(len(c) == 6 for c in per_choice) and len({tuple(c) for c in per_choice}) > 1
    done = three[-1]
    assert isinstance(done, Finished) and sum(isinstance(e, Finished) for e in three) == 1
    assert [c["index"] for c in done.choices] == [0, 1, 2] and done.usage.completion_tokens == 18


async def test_speculative_engine_matches_plain_greedy(loaded_model, model) -> None:  # noqa: ANN001
    text = ("Copy this exactly: the quick brown fox jumps over the lazy dog; the quick brown fox jumps "
            "over the lazy dog; the quick brown fox")
    prompt = tuple(loaded_model.tokenizer.encode(text))
    reqs = [("spec", prompt, 24)]
    engine = make_engine(loaded_model, model, 64, speculative="ngram")
    with anyio.fail_after(TIMEOUT_S):
        async with engine:
            batched = await generate_all(engine, reqs)
    assert any(len(e.token_ids) > 1 for e in batched["spec"] if isinstance(e, Token))  # drafts accepted
    await check_same_as_alone(loaded_model, model, batched, reqs)


@pytest.mark.parametrize("chat, width, n, max_tokens, length_penalty, early_stopping", [
    (False, 3, 2, 6, 1.0, False),
    (False, 4, 3, 10, 1.0, False),
    (False, 3, 3, 8, 0.5, True),
    (True, 3, 2, 12, 1.0, False),  # both results end in EOS
    (True, 3, 2, 12, 1.0, "never"),
])
async def test_beam_search_through_the_engine_equals_transformers(  # noqa: PLR0913
        loaded_model, model, hf_reference, chat, width, n, max_tokens, length_penalty, early_stopping) -> None:  # noqa: ANN001
    """The independent oracle: transformers' own beam search (generate(num_beams=...)) on the
    same GGUF in fp32, against the engine on the exact fp32 path: the same hypotheses in the
    same order, the same scores."""
    tok, c = loaded_model.tokenizer, loaded_model.config
    if chat:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                            add_special=False)
    else:
        prompt = tok.encode("The capital of France is")
    params = SamplingParams(beam_width=width, n=n, max_tokens=max_tokens, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    engine = make_engine(loaded_model, model, 64)
    with anyio.fail_after(TIMEOUT_S):
        async with engine:
            request = GenerateRequest("beam", prompt_token_ids=tuple(prompt), params=params)
            events = [e async for e in engine.generate(request)]
            assert engine.stats().kv_blocks_used == 0
    hf_model, _ = hf_reference
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n,
                                max_new_tokens=max_tokens, do_sample=False, length_penalty=length_penalty,
                                early_stopping=early_stopping, eos_token_id=list(c.eos_token_ids),
                                output_scores=True, return_dict_in_generate=True)
    want = []
    for row in out.sequences[:, len(prompt):].tolist():  # padded after an EOS
        ends = [i for i, t in enumerate(row) if t in c.eos_token_ids]
        want.append(tuple(row[:ends[0] + 1] if ends else row))
    assert [e.token_ids for e in events if isinstance(e, Token)] == want
    done = events[-1]
    assert isinstance(done, Finished)
    assert [c["score"] for c in done.choices] == pytest.approx(out.sequences_scores.tolist(), abs=1e-3)
