"""Memory-aware sizing and step caps (edgeinfer.worker.device_memory and the scheduler's use of it).

The CUDA measurements themselves run in the gpu-marked test at the end; the arithmetic and the
scheduler's reaction to a shrinking free memory are tested here with a fake runner reporting it.
"""

from __future__ import annotations

import pytest
import torch
from fake_runner import VOCAB, FakeRunner, Letters, expected_tokens

from edgeinfer.config import RuntimeConfig, SchedulerConfig
from edgeinfer.core.events import Token
from edgeinfer.core.messages import StepResult
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.core.scheduler import Scheduler
from edgeinfer.engine.model_actor import ModelActor
from edgeinfer.worker import device_memory
from kernels.dispatch import choose_backend

EOS = VOCAB - 1
MIB = 2**20


def test_pool_is_sized_from_what_the_worst_case_step_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_memory, "available_memory_bytes", lambda device: 1000 * MIB)
    cpu = torch.device("cpu")
    runtime = RuntimeConfig(kv_memory_fraction=0.5)
    assert device_memory.num_kv_blocks(runtime, MIB, cpu) == 500
    assert device_memory.num_kv_blocks(runtime, MIB, cpu, reserved_bytes=200 * MIB) == 400
    with pytest.raises(ValueError, match=r"after 1,049 MB held for a worst-case step.*max_num_batched_tokens"):
        device_memory.num_kv_blocks(runtime, MIB, cpu, reserved_bytes=1000 * MIB)
    # The default: --parallel sequences of --ctx tokens, refused with the figures when it does not fit.
    plan = RuntimeConfig(parallel=3, block_size=16)
    assert device_memory.num_kv_blocks(plan, MIB, cpu, context=1000) == 63 * 3
    with pytest.raises(ValueError, match=r"3 sequences \(--parallel\) of 8192 tokens \(--ctx\) needs 1,611 MB, "
                                         r"but 839 MB are available after 210 MB held"):
        device_memory.num_kv_blocks(plan, MIB, cpu, reserved_bytes=200 * MIB, context=8192)
    # A fixed count or byte budget is the user's word: no measurement, no reserve.
    assert device_memory.num_kv_blocks(RuntimeConfig(num_kv_blocks=7), MIB, cpu, reserved_bytes=10**12) == 7
    assert device_memory.num_kv_blocks(RuntimeConfig(kv_memory_bytes=3 * MIB), MIB, cpu, 10**12) == 3


def test_cpu_steps_are_not_measured_or_capped() -> None:
    assert device_memory.free_step_bytes(torch.device("cpu")) is None
    from edgeinfer.config import ModelConfig
    from edgeinfer.models.llama import LlamaModel
    from edgeinfer.models.synthetic import synthetic_model

    tiny = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position=128)
    loaded = synthetic_model(tiny, "int8", group_size=32, seed=1)
    model = LlamaModel(loaded.config, dict(loaded.weights), choose_backend("reference"))
    assert device_memory.worst_case_step_bytes(model, RuntimeConfig(), 512, 64) == 0


def make(free_bytes: int | None, per_token: int) -> tuple[Scheduler, ModelActor, FakeRunner]:
    runner = FakeRunner(num_blocks=64, block_size=4)
    runner.free_bytes = free_bytes
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48, kv_watermark=0.0)
    sched = Scheduler(cfg, num_blocks=64, block_size=4, max_model_len=128, vocab_size=VOCAB, eos_token_ids=(EOS,),
                      bytes_per_token=10, make_detokenizer=Letters, activation_bytes_per_token=per_token)
    return sched, ModelActor(runner, VOCAB, (EOS,)), runner


def run(sched: Scheduler, actor: ModelActor, on_step=None) -> tuple[list[int], dict[str, list[int]]]:  # noqa: ANN001
    sizes, tokens = [], {}
    for _ in range(200):
        if not sched.has_work:
            break
        plan = sched.schedule()
        sizes.append(plan.num_tokens)
        for event in sched.postprocess(plan, actor.execute(plan)):
            if isinstance(event, Token):
                tokens.setdefault(event.request_id, []).extend(event.token_ids)
        if on_step is not None:
            on_step(len(sizes))
    return sizes, tokens


PROMPT = [(3 * i + 1) % (VOCAB - 1) for i in range(40)]
LONG = [(5 * i + 2) % (VOCAB - 1) for i in range(100)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_prefill_shrinks_to_what_free_memory_holds_and_recovers() -> None:
    # No reading yet (first step) or plenty free: the whole 48-token budget.
    sched, actor, runner = make(free_bytes=10**9, per_token=1000)
    sched.add_request("a", PROMPT, PARAMS)
    sizes, tokens = run(sched, actor)
    assert sizes[0] == 40 and sched.num_memory_capped_steps == 0
    assert tokens["a"] == expected_tokens(PROMPT, 6)

    # Another program took memory: after the first step only 10 tokens' activations fit.
    sched, actor, runner = make(free_bytes=10_500, per_token=1000)
    sched.add_request("a", PROMPT, PARAMS)
    sched.add_request("b", LONG, PARAMS)
    # The reading is taken after each step: memory freed after the third step shows in the fifth plan.
    sizes, tokens = run(sched, actor, on_step=lambda n: setattr(runner, "free_bytes", 10**9) if n == 3 else None)
    assert sizes[0] == 48  # planned before any reading
    assert sizes[1:4] == [10, 10, 10]  # capped: a's decode and 9 of b's prompt tokens fit
    assert sizes[4] == 48  # memory came back: full chunks again
    assert sched.num_memory_capped_steps == 3
    assert tokens["a"] == expected_tokens(PROMPT, 6) and tokens["b"] == expected_tokens(LONG, 6)
    assert sched.block_manager.num_used == 0


def test_cap_never_starves_running_decodes() -> None:
    sched, actor, runner = make(free_bytes=0, per_token=1000)
    for i in range(4):
        sched.add_request(str(i), PROMPT[:5 + i], PARAMS)
    sizes, tokens = run(sched, actor)
    assert all(size >= 1 for size in sizes) and max(sizes[1:]) <= 4  # max_num_seqs tokens per step
    assert all(tokens[str(i)] == expected_tokens(PROMPT[:5 + i], 6) for i in range(4))


def test_free_memory_travels_in_the_step_result() -> None:
    result = StepResult(3, (1,), (5,), free_device_bytes=123)
    assert StepResult.from_dict(result.__dict__ | {"logprobs": None, "top_logprobs": None}) == result
    sched, actor, runner = make(free_bytes=77, per_token=0)
    sched.add_request("a", PROMPT[:8], PARAMS)
    assert actor.execute(sched.schedule()).free_device_bytes == 77


@pytest.mark.gpu
def test_worst_case_step_is_measured_and_held_back_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from edgeinfer.models.synthetic import synthetic_model
    from edgeinfer.worker.build import build_runners

    loaded = synthetic_model("135m", "int4", seed=5, max_position=1024)
    runtime = RuntimeConfig(device="cuda", kv_memory_fraction=0.05)
    small, _ = build_runners(loaded, runtime, step_tokens=64, step_seqs=4)
    loaded = synthetic_model("135m", "int4", seed=5, max_position=1024)
    big, _ = build_runners(loaded, runtime, step_tokens=1024, step_seqs=64)
    assert 0 < small.activation_bytes_per_token
    # The bigger step's attention and logits make its peak larger; its pool is smaller by it.
    assert big.activation_bytes_per_token * 1024 > small.activation_bytes_per_token * 64
    assert big.pool.num_blocks <= small.pool.num_blocks
    assert big.free_step_bytes() > 0


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8", "int4"])
def test_cpu_pool_commits_memory_only_where_written(kv_dtype: str) -> None:
    """A 0.5-1 GB CPU pool costs no resident memory until blocks are written (idle serve RSS: 6.4 GB
    -> 0.36 GB with the default 25% budget), reads as zeros, and its tensors are cache-line aligned."""
    import psutil

    from kernels.kv_pool import KVPool

    k, v = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    slots = torch.tensor([0, 1, 17, 4000, 65535], dtype=torch.int32)
    KVPool(1, 4096, 16, 3, 64, kv_dtype, kv_dtype, "cpu").write(0, k, v, slots)  # torch's one-time set-up
    process = psutil.Process()
    before = process.memory_info().rss
    pool = KVPool(30, 4096, 16, 3, 64, kv_dtype, kv_dtype, "cpu")
    assert pool.nbytes() > 400 * MIB
    assert process.memory_info().rss - before < 32 * MIB
    for cache in (pool.k_caches[0], pool.v_caches[-1]):
        for part in cache.tensors():
            flat = part.view(-1).view(torch.uint8)  # the first and last blocks: .any() of all would commit it
            assert part.data_ptr() % 64 == 0 and not flat[:4096].any() and not flat[-4096:].any()
    pool.write(0, k, v, slots)
    assert process.memory_info().rss - before < 32 * MIB


def test_engine_memory_plan_is_the_pool_it_built(default_model_path) -> None:  # noqa: ANN001
    """--ctx x --parallel sizes the pool, the plan printed at start describes that pool, and
    admission refuses what the plan has no room for, naming the context."""
    import anyio

    from edgeinfer.core.events import Error
    from edgeinfer.core.request import GenerateRequest
    from edgeinfer.engine.api import Engine, EngineConfig

    async def main() -> None:
        runtime = RuntimeConfig(max_model_len=1000, parallel=3, kv_dtype="int8")
        async with Engine(EngineConfig(str(default_model_path), runtime)) as engine:
            plan = engine.memory_plan
            pool = engine._runner.pool
            assert (plan.context, plan.kv_tokens) == (1000, 63 * 16 * 3) == (1000, pool.num_slots)
            assert plan.kv_bytes == pool.nbytes() and plan.k_dtype == plan.v_dtype == "int8"
            assert 60e6 < plan.weight_bytes < 100e6  # int4 weights; the embedding is read from the file
            assert plan.describe().startswith(f"weights {plan.weight_bytes / 1e6:,.0f} MB, KV cache int8 ")
            assert "3.02 x 1000-token sequences (cpu)" in plan.describe()
            async def last(prompt_tokens: int) -> object:
                request = GenerateRequest("r", prompt_token_ids=(1,) * prompt_tokens,
                                          params=SamplingParams(max_tokens=20, ignore_eos=True))
                return [e async for e in engine.generate(request)][-1]

            refused = await last(1000)
            assert isinstance(refused, Error) and refused.code == "prompt_too_long" and "1000" in refused.message
            ended = await last(990)  # the answer stops where the context ends
            assert ended.finish_reason == "length" and ended.usage.completion_tokens == 10

    anyio.run(main)
