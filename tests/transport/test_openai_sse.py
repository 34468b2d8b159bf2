"""The SSE chunks of OpenAIApi, driven straight from in-memory engine events (no server, no
model): what each chunk of a long completion stream says about the text before it."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from edgeinfer.core.events import Event, Finished, Token, TokenLogprob, Usage
from transport.openai_api import OpenAIApi
from transport.openai_shapes import Reply


class PieceTokenizer:
    def token_bytes(self, token_ids: list[int], skip_special: bool = False) -> bytes:
        return b"".join(b"<%d>" % t for t in token_ids)


async def engine_events(texts: list[str]) -> AsyncIterator[Event]:
    yield Token("r", (), "", 0.0)  # stands for `accepted`, which the route awaits before streaming
    for i, text in enumerate(texts):
        yield Token("r", (i,), text, 0.01 * i, (TokenLogprob(i, -0.25 * i, ((i, -0.25 * i),)),))
    yield Finished("r", "length", Usage(3, len(texts)))


def sse(texts: list[str]) -> list[dict[str, Any]]:
    server = SimpleNamespace(counters=collections.Counter(), engine=SimpleNamespace(tokenizer=PieceTokenizer()),
                             metrics=SimpleNamespace(observe=lambda usage: None))
    api, reply = OpenAIApi(server), Reply(False, "m", 1, True, True)

    async def main() -> list[str]:
        events = engine_events(texts)
        await anext(events)
        api.in_flight = 1
        return [chunk async for chunk in api._sse([events], reply, "prompt")]

    chunks = asyncio.run(main())
    assert chunks[-1] == "data: [DONE]\n\n" and all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [json.loads(c[6:]) for c in chunks[:-1]]


def test_a_long_stream_counts_each_chunks_text_offset_from_the_whole_text_before_it() -> None:
    texts = [("wö", "rd", " 😀", "\n", "", "x" * (i % 7))[i % 6] for i in range(600)]
    chunks = sse(texts)
    streamed = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert [c["choices"][0]["text"] for c in streamed] == texts  # empty texts too: they carry logprobs
    before = 0
    for i, (chunk, text) in enumerate(zip(streamed, texts, strict=True)):
        logprobs = chunk["choices"][0]["logprobs"]
        assert logprobs["text_offset"] == [before] and logprobs["tokens"] == [f"<{i}>"]
        before += len(text)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(texts)
