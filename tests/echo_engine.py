"""EchoEngine: a model-free test double with the Engine's interface, for the transport tests.

`generate(request)` is an async iterator of the same events (edgeinfer.core.events) the real Engine
yields, in the same order, with admission (a bounded waiting queue answered with `overloaded`),
a toy block pool that a request holds until its stream ends or is closed, and a fixed delay per
token. The answer is deterministic: the words of the prompt (or last chat message) echoed back,
cycled up to max_tokens, so server tests can assert exact outputs and timing without a model.
The engine's own task alone writes its state.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from edgeinfer.core.events import (
    INVALID_PARAMS,
    OVERLOADED,
    Accepted,
    Error,
    Event,
    Finished,
    Health,
    Token,
    Usage,
)
from edgeinfer.core.sampling_params import SamplingParams

BLOCK_SIZE = 16
VOCAB_SIZE = 49152


class EchoTokenizer:
    """Words as tokens: id = crc32(word) mod the vocabulary; enough for clients to count."""

    vocab_size = VOCAB_SIZE
    chat_template = None  # no tool syntax: the OpenAI API uses its generic tool call format

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) % VOCAB_SIZE for w in text.split()]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class EchoEngine:
    def __init__(self, token_delay_s: float = 0.002, max_running: int = 64, max_waiting: int = 256,
                 num_blocks: int = 4096) -> None:
        self.tokenizer = EchoTokenizer()
        self.token_delay_s = token_delay_s
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self._running = 0
        self._waiting: list[str] = []
        self._slots: asyncio.Condition | None = None  # created on the running loop
        self._tokens_total = 0

    async def __aenter__(self) -> EchoEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def health(self) -> Health:
        return Health("ok")

    def stats(self) -> dict[str, Any]:
        return {"num_running": self._running, "num_waiting": len(self._waiting),
                "kv_blocks_total": self.num_blocks, "kv_blocks_free": self.num_free_blocks,
                "kv_blocks_used": self.num_blocks - self.num_free_blocks,
                "num_generated_tokens": self._tokens_total}

    def answer_words(self, request: Any) -> list[str]:
        """The words the echo engine answers with (before cycling to max_tokens)."""
        if request.messages:
            source = request.messages[-1]["content"]
        elif request.prompt is not None:
            source = request.prompt
        else:
            source = " ".join(str(t) for t in request.prompt_token_ids)
        return source.split() or ["..."]

    async def generate(self, request: Any) -> AsyncIterator[Event]:
        params: SamplingParams = request.params
        rid = request.request_id
        arrival = time.monotonic()
        try:
            params.check_vocab(VOCAB_SIZE)
        except ValueError as exc:
            yield Error(rid, INVALID_PARAMS, str(exc))
            return
        if len(self._waiting) >= self.max_waiting:
            yield Error(rid, OVERLOADED, f"waiting queue full ({self.max_waiting} requests)",
                        retry_after_s=1.0)
            return
        if self._slots is None:
            self._slots = asyncio.Condition()
        if request.prompt_token_ids is not None:
            num_prompt = len(request.prompt_token_ids)
        else:
            text = request.prompt or self.tokenizer.apply_chat_template(list(request.messages))
            num_prompt = len(self.tokenizer.encode(text))
        self._waiting.append(rid)
        held_blocks = 0
        running = False
        try:
            ahead = len(self._waiting) - 1 + max(0, self._running + 1 - self.max_running)
            yield Accepted(rid, queue_position=ahead, prompt_tokens=num_prompt)
            async with self._slots:
                await self._slots.wait_for(self._turn_of(rid))
                self._waiting.remove(rid)
                self._running += 1
                running = True
            queued_s = time.monotonic() - arrival
            words = self.answer_words(request)
            first_s = 0.0
            held_blocks = self._hold(num_prompt, 0)
            for i in range(params.max_tokens):
                await asyncio.sleep(self.token_delay_s)
                word = words[i % len(words)]
                text = word if i == 0 else " " + word
                held_blocks += self._hold(num_prompt + i + 1, held_blocks)
                self._tokens_total += 1
                now = time.monotonic() - arrival
                first_s = first_s or now
                yield Token(rid, (zlib.crc32(word.encode()) % VOCAB_SIZE,), text, now)
            total = time.monotonic() - arrival
            completion = " ".join(words[i % len(words)] for i in range(params.max_tokens))
            tpot = (total - first_s) / max(1, params.max_tokens - 1)
            usage = Usage(num_prompt, params.max_tokens, queue_time_s=queued_s, ttft_s=first_s, tpot_s=tpot,
                          total_time_s=total, peak_kv_bytes=held_blocks * BLOCK_SIZE * 1024)
            yield Finished(rid, "length", usage, text=completion)
        finally:
            # Runs when the stream is closed early too (client gone or cancelled): free everything.
            if rid in self._waiting:
                self._waiting.remove(rid)
            if running:
                self._running -= 1
            self.num_free_blocks += held_blocks
            if self._slots is not None:
                self._notify()

    def _turn_of(self, rid: str) -> Callable[[], bool]:
        return lambda: self._running < self.max_running and self._waiting[0] == rid

    def _hold(self, num_tokens: int, held: int) -> int:
        """Take the blocks `num_tokens` need beyond the `held` ones; return how many were taken."""
        need = -(-num_tokens // BLOCK_SIZE) - held
        self.num_free_blocks -= max(0, need)
        return max(0, need)

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._slots:
                self._slots.notify_all()

        # The finally block may run during cancellation, where awaiting is not allowed: wake later.
        asyncio.get_running_loop().create_task(wake())
