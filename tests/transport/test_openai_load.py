"""64 concurrent streaming clients (AsyncOpenAI) on the default model with a small KV pool: every
stream completes with exactly its solo greedy run's text (no token lost, duplicated or
reordered), and when half of them disconnect mid-stream the block manager is all free afterwards
and the server holds no request. The slow variant is the 64-client one (32 tokens each); the
default one runs 16 clients of 4 tokens, to stay fast on a 2-core machine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest
from live_server import MODEL, TOKEN, LiveServer, serve_model

from edgeinfer.config import RuntimeConfig

PROMPTS = ["Name a colour.", "Count to five.", "What is rain?", "Say hello in French.",
           "Describe a cat.", "Why is the sky blue?", "Give me a fruit.", "What is 2 + 2?"]
KV_MEMORY_BYTES = 48 << 20  # room for ~2k tokens: the 64 streams share it (prefix cache, preemption)
TIMEOUT_S = 900.0  # a loaded 2-core machine


@pytest.fixture(scope="module")
def live(default_model_path):  # noqa: ANN001, ANN201
    server = serve_model(default_model_path, RuntimeConfig(kv_memory_bytes=KV_MEMORY_BYTES))
    yield server
    server.close()


def _request(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.mark.parametrize(("num_clients", "num_prompts", "max_tokens"),
                         [(16, 4, 4), pytest.param(64, 8, 32, marks=pytest.mark.slow)])
def test_streaming_clients_match_their_solo_runs_and_disconnects_free_the_pool(
        live: LiveServer, num_clients: int, num_prompts: int, max_tokens: int) -> None:
    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key=TOKEN, timeout=TIMEOUT_S,
                                    max_retries=0)
        solo = {}
        prompts = PROMPTS[:num_prompts]
        for prompt in prompts:  # one at a time: each prompt's answer alone in the batch
            reply = await client.chat.completions.create(**_request(prompt, max_tokens))
            assert reply.usage.completion_tokens == max_tokens
            solo[prompt] = reply.choices[0].message.content

        async def stream(i: int) -> tuple[str, list[str], str | None, int | None]:
            prompt = prompts[i % len(prompts)]
            leaves = i % 2 == 1  # half the clients go after their second piece of text
            chunks = await client.chat.completions.create(**_request(prompt, max_tokens), stream=True,
                                                          stream_options={"include_usage": True})
            pieces: list[str] = []
            finish, num_tokens = None, None
            async for chunk in chunks:
                num_tokens = chunk.usage.completion_tokens if chunk.usage else num_tokens
                for choice in chunk.choices:
                    pieces += [choice.delta.content] if choice.delta.content else []
                    finish = choice.finish_reason or finish
                if leaves and len(pieces) == 2:
                    await chunks.close()
                    break
            return prompt, pieces, finish, num_tokens

        results = await asyncio.gather(*(stream(i) for i in range(num_clients)))
        for i, (prompt, pieces, finish, num_tokens) in enumerate(results):
            text = "".join(pieces)
            if i % 2:
                assert len(pieces) == 2 and solo[prompt].startswith(text), (i, text, solo[prompt])
            else:
                assert (text, finish, num_tokens) == (solo[prompt], "length", max_tokens), (i, text, solo[prompt])
        engine, server = live.engine, live.server
        deadline = time.monotonic() + 30
        while True:
            stats = engine.stats()
            if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0 and server.openai.in_flight == 0:
                break
            assert time.monotonic() < deadline, f"requests still hold the engine: {stats}"
            await asyncio.sleep(0.05)
        assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total  # cached: free, kept for reuse
        await client.close()

    live.run(main(), TIMEOUT_S)
