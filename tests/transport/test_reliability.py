"""One request must never take the engine down (issue #19), on the real default model.

- Cancel races: generate then cancel a few milliseconds later, back to back.
- Property test: random interleavings of generate / cancel / status / disconnect with random
  small delays; every id gets exactly one terminal frame, KV blocks are all free at the end, the
  connection stays usable and the engine alive.
- Fault injection: a sampler that fails for one request of a batch of 8 (the other 7 give the
  tokens they give alone); a detokenizer failing on one request's token; a model step that fails
  (/healthz 503 while the supervisor restarts the model actor, then a new request succeeds).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, check_life_cycles, http_get, open_client, receive, send
from websockets.exceptions import ConnectionClosed

from edgeinfer.config import RuntimeConfig, SchedulerConfig
from edgeinfer.core.events import INTERNAL, Accepted, Error, Finished, Token
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.engine.api import Engine, SupervisionConfig
from edgeinfer.models.loader import load_model
from edgeinfer.worker.build import build_runners
from edgeinfer.worker.sampler import sample

RUNTIME = RuntimeConfig(linear_path="int4_cpu", num_kv_blocks=256, num_threads=2)
SCHEDULER = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def runner_and_model(default_model_path):  # noqa: ANN001, ANN201
    loaded = load_model(default_model_path)
    return build_runners(loaded, RUNTIME, SCHEDULER.max_num_batched_tokens, SCHEDULER.max_num_seqs)[0], loaded


def engine_over(runner_and_model: Any, **options: Any) -> Engine:
    runner, loaded = runner_and_model
    return Engine.from_runner(runner, loaded.tokenizer, loaded.config, SCHEDULER, **options)


@pytest.fixture(scope="module")
def live(runner_and_model: Any):  # noqa: ANN201
    @contextlib.asynccontextmanager
    async def open_engine() -> AsyncIterator[Engine]:
        async with engine_over(runner_and_model) as engine:
            yield engine

    server = LiveServer(open_engine)
    yield server
    server.close()


async def read_until_idle(ws: Any, frames: list[dict], open_ids: set[str], wait_for: set[str] | None = None,
                          timeout_s: float = 60.0) -> None:
    """Read frames, removing ids from open_ids as their terminal frames come, until none of
    wait_for (all of open_ids by default) is open."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while open_ids & (open_ids if wait_for is None else wait_for):
        frame = await receive(ws, max(0.1, deadline - loop.time()))
        frames.append(frame)
        if frame["type"] in ("done", "error") and frame.get("code") != "unknown_id":
            open_ids.discard(frame["id"])


async def assert_engine_idle(live: LiveServer) -> None:
    """All KV blocks free, nothing running or waiting, health ok (waits for the scheduler's next
    pass: a cancelled request's blocks are freed before its next step, not instantly)."""
    for _ in range(500):
        stats = live.engine.stats()
        if stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    stats = live.engine.stats()
    assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0), stats
    assert live.engine.health().ok
    status, _, body = await http_get(live.port, "/healthz")
    assert (status, body) == (200, b"ok\n")


def test_cancel_races_end_every_request_exactly_once(live: LiveServer) -> None:
    """40 generate + cancel pairs, each cancel 0-5 ms after its generate, back to back on one
    connection (keeping within the documented 16 in flight: a cancelled request holds its slot
    until its `done` is sent): each gets accepted then one done, the connection serves after."""
    async def main() -> None:
        ws = await open_client(live.url)
        frames: list[dict] = []
        rng = random.Random(7)
        open_ids: set[str] = set()
        for i in range(40):
            while len(open_ids) >= 16:
                frame = await receive(ws)
                frames.append(frame)
                if frame["type"] in ("done", "error"):
                    open_ids.discard(frame["id"])
            open_ids.add(f"r{i}")
            await send(ws, {"type": "generate", "id": f"r{i}", "prompt": "Count to ten:",
                            "params": {"max_tokens": 64, "temperature": 0}})
            await asyncio.sleep(rng.uniform(0, 0.005))
            await send(ws, {"type": "cancel", "id": f"r{i}"})
        await read_until_idle(ws, frames, open_ids)
        check_life_cycles(frames, {f"r{i}": 1 for i in range(40)})
        for i in range(40):
            mine = [f["type"] for f in frames if f.get("id") == f"r{i}"]
            assert mine[0] == "accepted" and mine[-1] == "done", (i, [f for f in frames if f.get("id") == f"r{i}"])
        await send(ws, {"type": "status"})
        status = await receive(ws)
        while status["type"] != "status":  # unknown_id answers to cancels that came after a done
            assert status["type"] == "error" and status["code"] == "unknown_id", status
            status = await receive(ws)
        assert status["requests"] == []
        await send(ws, {"type": "generate", "id": "after", "prompt": "Hi", "params": {"max_tokens": 3}})
        after: list[dict] = []
        await read_until_idle(ws, after, {"after"})
        assert after[-1]["type"] == "done" and after[-1]["finish_reason"] in ("length", "eos", "stop")
        await ws.close()
        await assert_engine_idle(live)

    live.run(main(), timeout_s=120)


@pytest.mark.parametrize("params", [
    {"n": 16, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 24, "temperature": 1.0, "seed": 3,
     "ignore_eos": True},
    {"beam_width": 16, "n": 16, "max_tokens": 12},
])
def test_the_widest_requests_finish(live: LiveServer, params: dict) -> None:
    """n x logprobs and beam_width x n at their limits used to overflow the request's event
    stream and be reported as engine_closed: every choice arrives, then one done (and the prompt's
    scores, once, before the first token)."""
    async def main() -> None:
        ws = await open_client(live.url)
        await send(ws, {"type": "generate", "id": "wide", "prompt": "List some colours:", "params": params})
        frames: list[dict] = []
        await read_until_idle(ws, frames, {"wide"}, timeout_s=120)
        assert frames[0]["type"] == "accepted" and frames[-1]["type"] == "done", frames[-1]
        assert len(frames[-1]["choices"]) == 16
        indices = {f.get("index", 0) for f in frames if f["type"] == "token"}
        assert indices == set(range(16))
        if "logprobs" in params:
            tokens = [f for f in frames if f["type"] == "token"]
            assert sum(len(f["token_ids"]) for f in tokens) == 16 * 24
            assert all(len(lp["top"]) == 20 for f in tokens for lp in f["logprobs"])
            assert [f["type"] for f in frames[:2]] == ["accepted", "prompt_logprobs"]
            assert sum(f["type"] == "prompt_logprobs" for f in frames) == 1
            assert len(frames[1]["logprobs"]) == frames[0]["prompt_tokens"] - 1
            assert all(len(lp["top"]) == 20 for lp in frames[1]["logprobs"])
        await ws.close()
        await assert_engine_idle(live)

    live.run(main(), timeout_s=180)


actions = st.lists(st.one_of(
    st.tuples(st.just("generate"), st.integers(1, 6)),  # max_tokens
    st.tuples(st.just("cancel"), st.integers(0, 7)),  # which earlier request (by age)
    st.tuples(st.just("reuse"), st.integers(0, 7)),  # wait for an earlier request's end, send its id again
    st.tuples(st.just("status"), st.just(0)),
    st.tuples(st.just("sleep"), st.integers(0, 15)),  # milliseconds
    st.tuples(st.just("disconnect"), st.just(0)),
), min_size=1, max_size=14)


def test_random_interleavings_keep_the_life_cycle(live: LiveServer) -> None:
    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(program=actions)
    def check(program: list[tuple[str, int]]) -> None:
        live.run(play(live, program), timeout_s=60)

    check()


async def play(live: LiveServer, program: list[tuple[str, int]]) -> None:
    ws = await open_client(live.url)
    frames: list[dict] = []
    sent: dict[str, int] = {}  # id -> generates sent on this connection
    order: list[str] = []  # ids in the order first sent
    open_ids: set[str] = set()
    for action, arg in program:
        if action in ("generate", "reuse"):
            if action == "reuse" and order:
                rid = order[-1 - arg % len(order)]
                await read_until_idle(ws, frames, open_ids, wait_for={rid})  # its terminal frame first
            else:
                rid = f"g{len(order)}"
                order.append(rid)
            sent[rid] = sent.get(rid, 0) + 1
            open_ids.add(rid)
            await send(ws, {"type": "generate", "id": rid, "prompt": f"Say {rid} again:",
                            "params": {"max_tokens": arg if action == "generate" else 2, "temperature": 0}})
        elif action == "cancel" and order:
            await send(ws, {"type": "cancel", "id": order[-1 - arg % len(order)]})
        elif action == "status":
            await send(ws, {"type": "status"})
        elif action == "sleep":
            await asyncio.sleep(arg / 1000)
        elif action == "disconnect":
            await ws.close()  # whatever was in flight is cancelled by the server
            ws, frames, sent, order, open_ids = await open_client(live.url), [], {}, [], set()
    await read_until_idle(ws, frames, open_ids)
    check_life_cycles(frames, sent)
    await ws.close()
    await assert_engine_idle(live)


# ---- fault injection --------------------------------------------------------------------------

POISON_TOKEN = 4321  # a request carrying logit_bias {POISON_TOKEN: 0} (a no-op bias) is the one to fail


def sampler_failing_on_poison(logits: Any, batch: Any) -> Any:
    if (batch.bias_ids == POISON_TOKEN).any():
        raise RuntimeError("injected sampler fault")
    return sample(logits, batch)


PROMPTS = [f"Write one line about the number {i}:" for i in range(8)]


async def tokens_and_last(engine: Engine, rid: str, prompt: str, **params: Any) -> tuple[list[int], Any]:
    request = GenerateRequest(rid, prompt=prompt, params=SamplingParams(temperature=0, max_tokens=8,
                                                                         ignore_eos=True, **params))
    events = [e async for e in engine.generate(request)]
    assert isinstance(events[0], (Accepted, Error)) and sum(isinstance(e, (Finished, Error)) for e in events) == 1
    return [t for e in events if isinstance(e, Token) for t in e.token_ids], events[-1]


def test_a_sampler_fault_fails_one_request_of_eight(runner_and_model: Any) -> None:
    async def main() -> None:
        async with engine_over(runner_and_model, sampler=sampler_failing_on_poison) as engine:
            alone = [(await tokens_and_last(engine, f"alone{i}", p))[0] for i, p in enumerate(PROMPTS)]
            results = await asyncio.gather(*(
                tokens_and_last(engine, f"batch{i}", p, **({"logit_bias": {POISON_TOKEN: 0.0}} if i == 3 else {}))
                for i, p in enumerate(PROMPTS)))
            for i, (tokens, last) in enumerate(results):
                if i == 3:
                    assert isinstance(last, Error) and last.code == INTERNAL
                    assert "injected sampler fault" in last.message
                else:
                    assert isinstance(last, Finished) and tokens == alone[i], i
            stats = engine.stats()
            assert stats.kv_blocks_used == 0 and engine.health().ok and engine.health().restarts == 0

    asyncio.run(asyncio.wait_for(main(), 120))


class FailingDetokenizer:
    """The tokenizer's own detokenizer, failing on POISON_TOKEN."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def push(self, token_id: int) -> str:
        if token_id == POISON_TOKEN:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return self.inner.push(token_id)


class TokenizerWithFaults:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def detokenizer(self) -> FailingDetokenizer:
        return FailingDetokenizer(self._inner.detokenizer())


def test_a_detokenizer_fault_fails_that_request_alone(runner_and_model: Any) -> None:
    runner, loaded = runner_and_model

    async def main() -> None:
        engine = Engine.from_runner(runner, TokenizerWithFaults(loaded.tokenizer), loaded.config, SCHEDULER)
        async with engine:
            alone = (await tokens_and_last(engine, "alone", PROMPTS[0]))[0]
            # +100 on the poison token: that request samples it first, the other never does.
            (_, bad), (tokens, good) = await asyncio.gather(
                tokens_and_last(engine, "bad", PROMPTS[1], logit_bias={POISON_TOKEN: 100.0}),
                tokens_and_last(engine, "good", PROMPTS[0]))
            assert isinstance(bad, Error) and bad.code == INTERNAL and "injected detokenizer fault" in bad.message
            assert isinstance(good, Finished) and tokens == alone
            assert engine.stats().kv_blocks_used == 0 and engine.health().ok

    asyncio.run(asyncio.wait_for(main(), 120))


class RunnerWithFaults:
    """The real runner; `arm()` makes its next forward raise."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._armed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def arm(self) -> None:
        self._armed.set()

    def logits(self, chunks: Any) -> Any:
        if self._armed.is_set():
            self._armed.clear()
            raise RuntimeError("injected model fault")
        return self._inner.logits(chunks)


def test_a_failing_model_step_restarts_the_engine(runner_and_model: Any) -> None:
    runner = RunnerWithFaults(runner_and_model[0])

    @contextlib.asynccontextmanager
    async def open_engine() -> AsyncIterator[Engine]:
        async with engine_over((runner, runner_and_model[1]),
                               supervision=SupervisionConfig(restart_delay_s=1.0)) as engine:
            yield engine

    live = LiveServer(open_engine)
    try:
        async def main() -> None:
            ws = await open_client(live.url)
            runner.arm()
            await send(ws, {"type": "generate", "id": "hit", "prompt": "Hello", "params": {"max_tokens": 4}})
            frames = [await receive(ws), await receive(ws)]
            assert [f["type"] for f in frames] == ["accepted", "error"] and frames[1]["code"] == "internal_error"
            assert "injected model fault" in frames[1]["message"]
            status, _, body = await http_get(live.port, "/healthz")
            assert status == 503 and body.startswith(b"restarting: a model step failed: RuntimeError: injected")
            # Sent while restarting: queued, then served once the model actor is back.
            await send(ws, {"type": "generate", "id": "next", "prompt": "Hello", "params": {"max_tokens": 4}})
            rest: list[dict] = []
            await read_until_idle(ws, rest, {"next"})
            assert rest[0]["type"] == "accepted" and rest[-1]["type"] == "done", rest
            status, _, body = await http_get(live.port, "/healthz")
            assert (status, body) == (200, b"ok\n")
            assert live.engine.health().restarts == 1 and live.engine.stats().kv_blocks_used == 0
            await ws.close()

        live.run(main(), timeout_s=120)
    finally:
        live.close()


# ---- fuzzing the real engine ------------------------------------------------------------------

DOCUMENTED_CODES = {"bad_frame", "frame_too_large", "unknown_type", "unknown_field", "invalid_message",
                    "invalid_params", "duplicate_id", "unknown_id", "too_many_requests", "prompt_too_long",
                    "overloaded", "slow_reader"}
PARAM_NAMES = ["temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "logit_bias", "seed", "n", "logprobs", "prompt_logprobs", "max_tokens",
               "min_tokens", "stop", "stop_token_ids", "ignore_eos", "beam_width", "length_penalty", "early_stopping"]


class Deep:
    """A nested value built only when the frame is encoded (hypothesis prints examples
    recursively, and cannot print one 900 levels deep)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"Deep({self.depth})"

    def build(self) -> Any:
        value: Any = 1
        for i in range(self.depth):
            value = [value] if i % 2 else {"a": value}
        return value


def materialize(value: Any) -> Any:
    if isinstance(value, Deep):
        return value.build()
    if isinstance(value, list):
        return [materialize(v) for v in value]
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


extreme = st.sampled_from([
    2**64, -(2**64), 2**63, 2**31, 10**30, -1, 0, 1, 20, 64, 1e308, -1e308, float("nan"), float("inf"),
    -0.0, 5e-324, True, None, "", "\ud800", "a\udfffb", "x" * 300, [], {}, [0.5, 2**64], {"1": 1e308}])
fuzz_values = st.recursive(
    extreme | st.integers() | st.floats() | st.text(st.characters(codec=None), max_size=8)
    | st.integers(1, 900).map(Deep) | st.integers(1000, 60000).map(lambda n: list(range(0, n, 7))),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
# Nesting past any recursion limit, as raw frames (no encoder would produce them).
too_deep = st.sampled_from(["[" * 100_000, '{"a":' * 50_000, b"\x91" * 200_000 + b"\x01",
                            b"\x81\xa1a" * 100_000 + b"\x01"])
fuzz_objects = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "chat", "cancel", "status", "hello", "gen", ""]) | fuzz_values},
    optional={"id": st.sampled_from(["a", "b", "\ud800", "x" * 129]) | fuzz_values,
              "prompt": st.sampled_from(["Hello", "\ud800", ""]) | fuzz_values,
              "prompt_token_ids": st.lists(st.sampled_from([0, 1, 48999, 49152, 2**31, -1, 2**64]), max_size=4)
              | fuzz_values,
              "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "bot"]) | fuzz_values,
                                                          "content": st.sampled_from(["Hi", "\udc00"]) | fuzz_values}),
                                   max_size=2) | fuzz_values,
              "params": st.dictionaries(st.sampled_from(PARAM_NAMES + ["\ud800", "top_kk"]), fuzz_values,
                                        max_size=4) | fuzz_values,
              "version": st.just("edgeinfer/1") | fuzz_values})


# Mostly-valid requests with fuzzed parameters, and one field (any, or a new one) replaced.
fuzz_params = st.dictionaries(st.sampled_from(PARAM_NAMES), st.none() | st.booleans() | st.integers(-3, 70)
                              | st.floats(-3, 3) | extreme | fuzz_values, max_size=3)
near_valid = st.builds(
    lambda base, params, key, value, replace: {**base, "params": params, **({key: value} if replace else {})},
    st.sampled_from([{"type": "generate", "id": "a", "prompt": "Hello"},
                     {"type": "chat", "id": "b", "messages": [{"role": "user", "content": "Hi"}]},
                     {"type": "generate", "id": "c", "prompt_token_ids": [1, 2, 3]}]),
    fuzz_params, st.sampled_from(["type", "id", "prompt", "messages", "prompt_token_ids", "params", "x"]),
    fuzz_values, st.integers(0, 3).map(lambda i: i == 0))


def encode_fuzz(obj: Any, kind: str, raw: str | bytes) -> str | bytes:
    """One frame: obj as JSON (lone surrogates escaped, NaN written as such) or msgpack (lone
    surrogates as invalid UTF-8), or the raw bytes/text (also when msgpack cannot hold an integer
    past 64 bits)."""
    obj = materialize(obj)
    if kind == "json":
        return json.dumps(obj, allow_nan=True)
    if kind == "msgpack":
        with contextlib.suppress(OverflowError, ValueError):
            return msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    return raw


def test_fuzzed_frames_get_documented_answers_from_the_real_engine(live: LiveServer) -> None:
    """Random frames with extreme numbers, lone surrogates, deep nesting, huge arrays and wrong
    types in every field: each is answered with a documented code (or the documented close 1008
    for a bad second hello); nothing is internal_error; the engine serves after."""
    state: dict[str, Any] = {}
    seen: collections.Counter[str] = collections.Counter()

    async def exchange(frame: str | bytes) -> list[dict]:
        if "ws" not in state:
            state["ws"] = await open_client(live.url)
        ws = state["ws"]
        try:
            await ws.send(frame)
            # A status, then a status of an id never used: its unknown_id answer marks the end of
            # what this frame caused (the fuzzed frame may itself be a status request).
            await send(ws, {"type": "status"})
            await send(ws, {"type": "status", "id": "end-probe"})
            answers: list[dict] = []
            while not answers or answers[-1].get("id") != "end-probe":
                answers.append(await receive(ws, 10))
        except ConnectionClosed as exc:
            assert exc.rcvd is not None and exc.rcvd.code == 1008 and exc.rcvd.reason == "unsupported_version", exc
            del state["ws"]
            return [{"type": "closed 1008"}]
        assert answers[-1]["code"] == "unknown_id" and answers[-2]["type"] == "status", answers[-2:]
        answers.pop()
        for answer in answers[:-1]:
            assert answer["type"] in ("accepted", "prompt_logprobs", "token", "done", "error", "status"), answer
            assert answer["type"] != "error" or answer["code"] in DOCUMENTED_CODES, answer
        # A frame that started a request: cancel it and see it end, freeing the id.
        open_ids = {row["id"] for row in answers[-1]["requests"]}
        for rid in open_ids:
            await send(ws, {"type": "cancel", "id": rid})
        rest: list[dict] = []
        await read_until_idle(ws, rest, open_ids, timeout_s=30)
        assert all(f["type"] != "error" or f["code"] in DOCUMENTED_CODES for f in rest), rest
        return answers[:-1] + rest

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(obj=near_valid | fuzz_objects | fuzz_values, kind=st.sampled_from(["json", "msgpack", "raw"]),
           raw=st.binary(max_size=64) | st.text(max_size=64) | too_deep)
    def check(obj: Any, kind: str, raw: str | bytes) -> None:
        for answer in live.run(exchange(encode_fuzz(obj, kind, raw)), timeout_s=60):
            event(answer.get("code", answer["type"]))
            seen[answer.get("code", answer["type"])] += 1

    check()
    # The engine itself was exercised: some frames were valid requests, some valid-looking ones
    # carried parameters out of range.
    # (6 runs: 12-22 accepted, 22-47 invalid_params; the bounds leave room for the random draw.)
    assert seen["accepted"] >= 3 and seen["invalid_params"] >= 5, seen

    async def after() -> None:
        if "ws" in state:
            await state["ws"].close()
        ws = await open_client(live.url)
        await send(ws, {"type": "generate", "id": "after", "prompt": "Hi", "params": {"max_tokens": 3}})
        frames: list[dict] = []
        await read_until_idle(ws, frames, {"after"})
        assert frames[0]["type"] == "accepted" and frames[-1]["type"] == "done", frames
        await ws.close()
        await assert_engine_idle(live)

    live.run(after())
