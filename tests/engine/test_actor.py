"""Actor runtime and Engine wiring with a fake model runner: tell/ask, failure, cancellation."""

from __future__ import annotations

import os
import sys
import threading
import time

import anyio
import pytest
from fake_runner import VOCAB, FakeRunner, Letters, expected_tokens

from edgeinfer.config import ModelConfig, RuntimeConfig, SchedulerConfig
from edgeinfer.core.events import ENGINE_CLOSED, INTERNAL, Accepted, Error, Finished, Token
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.engine.actor import ActorFailed, mailbox, serve
from edgeinfer.engine.api import Engine, SupervisionConfig
from edgeinfer.engine.model_actor import compute_thread

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeTokenizer:
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return [1 + ord(ch) % (VOCAB - 1) for ch in text]

    def detokenizer(self) -> Letters:
        return Letters()


CONFIG = ModelConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                     num_kv_heads=1, head_dim=8, max_position=256, eos_token_ids=(0,))


def fake_engine(runner: FakeRunner, **scheduler) -> Engine:  # noqa: ANN003
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 8, "kv_watermark": 0.0, **scheduler}
    cfg = SchedulerConfig(**settings)
    return Engine.from_runner(runner, FakeTokenizer(), CONFIG, cfg)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


async def collect(engine: Engine, request: GenerateRequest) -> list:
    return [event async for event in engine.generate(request)]


async def test_tell_ask_and_failure_reply() -> None:
    seen = []

    async def handle(msg: int) -> int:
        if msg < 0:
            raise ValueError("negative")
        seen.append(msg)
        return msg * 2

    ref, inbox = mailbox("double", 2)
    with anyio.fail_after(5):
        with pytest.raises(Exception) as err:  # noqa: B017 - the task group wraps it in a group
            async with anyio.create_task_group() as tg:
                await tg.start(serve, "double", inbox, handle)
                await ref.tell(1)
                assert await ref.ask(3) == 6
                with pytest.raises(ActorFailed):
                    await ref.ask(-1)  # the asker is answered before the actor dies
    assert seen == [1, 3]
    assert "negative" in repr(err.value)


async def test_tell_posts_before_it_yields() -> None:
    """A told message is in the mailbox before tell first yields to the event loop (a burst of
    submissions parsed in one loop pass must all be there when the scheduler next looks), and a
    full mailbox still makes tell wait."""
    ref, inbox = mailbox("box", 1)
    with inbox:
        told = ref.tell("first")
        with pytest.raises(StopIteration):
            told.send(None)  # ran to completion without yielding
        assert inbox.receive_nowait().message == "first"
        with pytest.raises(StopIteration):
            ref.tell("fills").send(None)
        waiting = ref.tell("waits")
        waiting.send(None)  # suspended: the mailbox is full
        waiting.close()


async def test_engine_streams_and_stats() -> None:
    runner = FakeRunner(num_blocks=16)
    with anyio.fail_after(10):
        async with fake_engine(runner) as engine:
            events = await collect(engine, GenerateRequest("a", prompt="hello", params=greedy(5)))
            assert isinstance(events[0], Accepted) and isinstance(events[-1], Finished)
            tokens = [t for e in events if isinstance(e, Token) for t in e.token_ids]
            assert tokens == expected_tokens(FakeTokenizer().encode("hello"), 5)
            usage = events[-1].usage
            # 5 + 4 tokens in KV (the last sampled one never is): 3 blocks of 4 slots, 10 bytes each
            assert (usage.prompt_tokens, usage.completion_tokens, usage.peak_kv_bytes) == (5, 5, 3 * 4 * 10)
            stats = engine.stats()
            assert stats.num_generated_tokens == 5 and stats.kv_blocks_used == 0 and stats.num_running == 0
            bad = await collect(engine, GenerateRequest("b", params=greedy(5)))
            assert bad[0].code == "invalid_params"
        late = await collect(engine, GenerateRequest("c", prompt="x"))
        assert [type(e) for e in late] == [Error] and late[0].code == ENGINE_CLOSED


async def test_every_step_runs_on_the_one_compute_thread() -> None:
    """All torch work of an engine runs on one thread (engine/model_actor.compute_thread: a
    second OpenMP pool made every parallel region wake its threads through the kernel), and it
    is not the event loop's thread; a restart after a failed step keeps that thread."""
    threads: list[int] = []
    fail_once = [True]

    def on_step(chunks) -> None:  # noqa: ANN001
        threads.append(threading.get_ident())
        if fail_once[0] and len(threads) == 2:
            fail_once[0] = False
            raise RuntimeError("one failed step")

    runner = FakeRunner(num_blocks=16, on_step=on_step)
    engine = Engine.from_runner(runner, FakeTokenizer(), CONFIG, SchedulerConfig(max_num_seqs=4, kv_watermark=0.0),
                                supervision=SupervisionConfig(restart_delay_s=0.0))
    with anyio.fail_after(10):
        async with engine:
            await collect(engine, GenerateRequest("a", prompt="hello", params=greedy(5)))  # fails at step 2
            events = await collect(engine, GenerateRequest("b", prompt="hello", params=greedy(5)))
            assert isinstance(events[-1], Finished) and engine.health().restarts == 1
    assert len(threads) > 3 and len(set(threads)) == 1 and threads[0] != threading.get_ident()


async def test_cancel_frees_blocks_before_next_step_even_mid_prefill() -> None:
    """A consumer that stops reading cancels its request: the next step no longer has it and its
    blocks are already free when that step runs (checked from inside the runner)."""
    checks: list[tuple[int, int]] = []  # per step: (chunks, blocks in use while it runs)
    cancelled = threading.Event()
    engine: Engine

    def on_step(chunks) -> None:  # noqa: ANN001 - runs in the model thread while the scheduler waits
        checks.append((len(chunks), engine._scheduler_actor.scheduler.block_manager.num_used))
        if len(checks) == 2:
            cancelled.wait(5)  # the client goes away while the second prefill chunk runs

    runner = FakeRunner(num_blocks=16, on_step=on_step)
    engine = fake_engine(runner, max_num_batched_tokens=4)
    with anyio.fail_after(10):
        async with engine:
            # 14-token prompt, 4 tokens per step: cancelled during its second chunk, mid-prefill.
            stream = engine.generate(GenerateRequest("long", prompt="abcdefghijklmn", params=greedy(4)))
            assert isinstance(await stream.__anext__(), Accepted)
            while len(checks) < 2:
                await anyio.sleep(0.001)
            await stream.aclose()
            cancelled.set()
            other = await collect(engine, GenerateRequest("next", prompt="hi", params=greedy(2)))
            assert isinstance(other[-1], Finished)
            # Steps 1-2 held long's 4 blocks; every step after the cancel only next's one block.
            assert checks[:2] == [(1, 4), (1, 4)] and checks[2:] == [(1, 1), (1, 1)]
            assert engine.stats().kv_blocks_used == 0

            with anyio.move_on_after(0.2):  # cancel a decoding consumer from outside
                async for _event in engine.generate(GenerateRequest("slow", prompt="a", params=greedy(200))):
                    await anyio.sleep(0.01)
            await anyio.sleep(0.05)
            assert engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0


async def test_model_that_keeps_failing_fails_its_requests_then_the_engine() -> None:
    """Every open stream gets exactly one internal_error; a model step failing max_failures times
    in a row (here 2) makes the supervisor give up: health "failed", later requests refused."""
    fail = threading.Event()

    def on_step(chunks) -> None:  # noqa: ANN001
        if fail.is_set():
            raise RuntimeError("boom in the model")

    runner = FakeRunner(num_blocks=16, on_step=on_step)
    results: dict[str, list] = {}

    async def client(engine: Engine, rid: str) -> None:
        results[rid] = await collect(engine, GenerateRequest(rid, prompt="ab", params=greedy(20)))

    engine = Engine.from_runner(runner, FakeTokenizer(), CONFIG, SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, kv_watermark=0.0),
        supervision=SupervisionConfig(restart_delay_s=0.0, max_failures=2))
    with anyio.fail_after(10):
        async with engine:
            async with anyio.create_task_group() as tg:
                for rid in ("x", "y", "z"):
                    tg.start_soon(client, engine, rid)
                while engine.stats().num_generated_tokens < 6:
                    await anyio.sleep(0.001)
                fail.set()
            assert engine.health().restarts == 1 and engine.error is None  # one failure: restarted
            second = await collect(engine, GenerateRequest("second", prompt="a", params=greedy(3)))
            assert isinstance(second[0], Accepted) and second[-1].code == INTERNAL
            with anyio.fail_after(5):
                while engine.error is None:
                    await anyio.sleep(0.001)
            assert engine.health().status == "failed" and "2 model steps failed" in engine.health().reason
            late = await collect(engine, GenerateRequest("late", prompt="a"))
            assert [type(e) for e in late] == [Error] and late[0].code == INTERNAL
    for rid in ("x", "y", "z"):
        assert isinstance(results[rid][-1], Error) and results[rid][-1].code == INTERNAL, results[rid][-1]
        assert "boom in the model" in results[rid][-1].message
        assert sum(isinstance(e, (Error, Finished)) for e in results[rid]) == 1


async def test_the_models_sampling_defaults_fill_what_a_client_left_unset() -> None:
    """generation_config.json says greedy: a client request that sets no temperature decodes
    greedily; one that sets it samples at its own; a tool's request (params_given None) is as built."""
    tokenizer = FakeTokenizer()
    tokenizer.sampling_defaults = {"temperature": 0.0}
    hot = SamplingParams(temperature=100.0, max_tokens=8, seed=3)
    with anyio.fail_after(10):
        async with Engine.from_runner(FakeRunner(num_blocks=16), tokenizer, CONFIG,
                                      SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)) as engine:
            def tokens(events: list) -> list[int]:
                return [t for e in events if isinstance(e, Token) for t in e.token_ids]

            typed = frozenset({"max_tokens", "seed", "top_p"})
            unset = await collect(engine, GenerateRequest("a", prompt="hello", params=hot, params_given=typed))
            assert tokens(unset) == expected_tokens(tokenizer.encode("hello"), 8)
            own = await collect(engine, GenerateRequest("b", prompt="hello", params=hot,
                                                        params_given=typed | {"temperature"}))
            tool = await collect(engine, GenerateRequest("c", prompt="hello", params=hot))
            assert tokens(own) == tokens(tool) != tokens(unset)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a niceness per thread is Linux's")
def test_the_compute_thread_runs_at_the_added_niceness() -> None:
    """compute_thread(nice) lowers its own thread's priority by `nice` (RuntimeConfig.compute_nice),
    not the caller's (the event loop's), and threads it starts (OpenMP's) inherit it."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def own_and_child() -> tuple[int, int]:
        seen: list[int] = []
        child = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), seen[0]

    for nice, expected in ((3, min(19, before + 3)), (0, before)):
        thread = compute_thread(nice)
        try:
            assert thread.submit(own_and_child).result() == (expected, expected)
        finally:
            thread.shutdown()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    with pytest.raises(ValueError, match="compute_nice must be in"):
        RuntimeConfig(compute_nice=20)


@pytest.mark.parametrize("window_s", [0.0005, 0.0])
async def test_requests_sent_together_share_an_idle_engines_first_step(window_s: float) -> None:
    """Requests submitted a few event-loop passes apart (a server parsing a burst of them one by
    one) all join the first step of an idle engine instead of the first running alone; with
    SchedulerConfig.burst_window_s 0 the first step is planned at once, without the later ones."""
    steps: list[list[int]] = []  # per step: the prompt tokens each chunk carried
    runner = FakeRunner(num_blocks=64, on_step=lambda chunks: steps.append([len(c.token_ids) for c in chunks]))
    engine = fake_engine(runner, max_num_batched_tokens=64, burst_window_s=window_s)

    async def after_passes(passes: int, request_id: str) -> None:
        for _ in range(passes):
            await anyio.lowlevel.checkpoint()
        await collect(engine, GenerateRequest(request_id, prompt="hello there", params=greedy(3)))

    with anyio.fail_after(10):
        async with engine, anyio.create_task_group() as tg:
            for i, passes in enumerate((0, 3, 10, 30)):
                tg.start_soon(after_passes, passes, f"r{i}")
    assert steps[0] == [11, 11, 11, 11] if window_s else len(steps[0]) < 4, steps
    with pytest.raises(ValueError, match="burst_window_s must be in"):
        SchedulerConfig(burst_window_s=-1.0)


async def test_a_burst_window_the_loop_overran_does_not_end_the_burst() -> None:
    """A request parsed while the loop is blocked past the window (a server handling the rest of a
    burst, the process descheduled) still joins the first step, though it is submitted only some
    loop passes after the window's timer fell due."""
    steps: list[int] = []
    runner = FakeRunner(num_blocks=64, on_step=lambda chunks: steps.append(len(chunks)))
    engine = fake_engine(runner, max_num_batched_tokens=64, burst_window_s=0.0005)

    async def busy_then_submit() -> None:
        await anyio.lowlevel.checkpoint()  # after the first submission
        time.sleep(0.01)  # blocks the loop past the window and BURST_OVERRUN_S
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        await collect(engine, GenerateRequest("late", prompt="hello there", params=greedy(3)))

    with anyio.fail_after(10):
        async with engine, anyio.create_task_group() as tg:
            tg.start_soon(collect, engine, GenerateRequest("first", prompt="hello there", params=greedy(3)))
            tg.start_soon(busy_then_submit)
    assert steps[0] == 2, steps


async def test_a_lone_request_on_a_starved_loop_waits_out_two_windows_at_most() -> None:
    """Every window overruns while other work keeps the loop busy; without news only one more
    window follows an overrun, not all BURST_MAX_WINDOWS of them."""
    steps: list[int] = []
    runner = FakeRunner(num_blocks=64, on_step=lambda chunks: steps.append(len(chunks)))
    engine = fake_engine(runner, max_num_batched_tokens=64, burst_window_s=0.0005)
    busy_passes = 0

    async def starve() -> None:
        nonlocal busy_passes
        while not steps:
            time.sleep(0.004)  # past the window and BURST_OVERRUN_S
            busy_passes += 1
            await anyio.lowlevel.checkpoint()

    with anyio.fail_after(10):
        async with engine, anyio.create_task_group() as tg:
            tg.start_soon(collect, engine, GenerateRequest("lone", prompt="hello there", params=greedy(3)))
            tg.start_soon(starve)
    # ~3 busy passes per window: all BURST_MAX_WINDOWS took 63, two windows and the step's
    # dispatch take 9.
    assert steps[0] == 1 and busy_passes < 25, (steps, busy_passes)
