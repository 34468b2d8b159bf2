"""The OpenAI-compatible API, driven by the official `openai` client (sync and async) against a
live server on the default model, and by raw httpx for every error shape."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from echo_engine import EchoEngine
from live_server import MODEL, TOKEN, LiveServer, serve_model

from edgeinfer.core.events import Health
from transport.server import Server, ServerConfig

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TIMEOUT_S = 120.0  # a loaded 2-core test machine can take seconds per token


@pytest.fixture(scope="module")
def live(default_model_path):  # noqa: ANN001, ANN201
    server = serve_model(default_model_path)
    yield server
    server.close()


def base_url(live: LiveServer) -> str:
    return f"http://127.0.0.1:{live.port}/v1"


def test_models_and_a_chat_completion_in_openais_shape(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=base_url(live), api_key=TOKEN, timeout=TIMEOUT_S)
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
        max_tokens=8, temperature=0)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == MODEL
    assert abs(reply.created - time.time()) < 60
    choice = reply.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    usage = reply.usage
    assert usage.completion_tokens <= 8 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    assert set(reply.model_extra["timings"]) >= {"ttft_s", "tpot_s", "queue_time_s", "cached_prompt_tokens"}


def test_chat_stream_equals_the_whole_answer_and_ends_with_usage(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=base_url(live), api_key=TOKEN, timeout=TIMEOUT_S)
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_list_prompts_n_and_logprobs(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=base_url(live), api_key=TOKEN, timeout=TIMEOUT_S)
    reply = client.completions.create(model=MODEL, prompt=["Once upon a time", "The sky is"], n=2, max_tokens=5,
                                      temperature=0.8, seed=3, logprobs=2, extra_body={"ignore_eos": True})
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion"
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        lp = choice.logprobs
        assert choice.finish_reason == "length" and len(lp.tokens) == len(lp.token_logprobs) == 5
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(top) <= 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-4
                   for i, top in enumerate(lp.top_logprobs))
    assert reply.usage.completion_tokens == 20
    ids = client.post("/../tokenize", body={"prompt": "The sky is"}, cast_to=httpx.Response).json()
    by_ids = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    greedy = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=1)
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4,
                                                              temperature=0, logprobs=1, stream=True)]
    assert "".join(c.text for c in chunks) == greedy.choices[0].text
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert sum((lp.tokens for lp in streamed), []) == greedy.choices[0].logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == greedy.choices[0].logprobs.text_offset


def test_chat_logprobs_in_the_content_shape(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=base_url(live), api_key=TOKEN, timeout=TIMEOUT_S)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert 1 <= len(content) <= 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_chat_logprobs_without_alternatives(live: LiveServer) -> None:
    """logprobs=true alone: each token's own logprob and no alternatives (the sampler's top-k of 0),
    sampled as well as greedy."""
    client = openai.OpenAI(base_url=base_url(live), api_key=TOKEN, timeout=TIMEOUT_S)
    for temperature in (0, 0.8):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                               temperature=temperature, logprobs=True, seed=3)
        content = reply.choices[0].logprobs.content
        assert 1 <= len(content) <= 4 and reply.choices[0].finish_reason in ("stop", "length")
        assert all(entry.top_logprobs == [] and entry.logprob <= 0 for entry in content)


def test_async_client_seed_reproducibility_streaming_and_not(live: LiveServer) -> None:
    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=base_url(live), api_key=TOKEN, timeout=TIMEOUT_S)
        kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
                                  "max_tokens": 10, "temperature": 0.9, "seed": 1234}
        first, second = await asyncio.gather(client.chat.completions.create(**kwargs),
                                             client.chat.completions.create(**kwargs))
        assert first.choices[0].message.content == second.choices[0].message.content
        stream = await client.chat.completions.create(**kwargs, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == first.choices[0].message.content
        other = await client.chat.completions.create(**{**kwargs, "seed": 99, "n": 2})
        assert len(other.choices) == 2
        await client.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_tokenize_and_detokenize(live: LiveServer) -> None:
    url = f"http://127.0.0.1:{live.port}"
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}, headers=AUTH, timeout=TIMEOUT_S).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH, timeout=TIMEOUT_S).json()
    assert text["prompt"].endswith("Hello world")
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=AUTH,
                      timeout=TIMEOUT_S)
    assert chat.json()["count"] > tokens["count"]


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_error_shapes_from_the_real_engine(live: LiveServer) -> None:
    url = f"http://127.0.0.1:{live.port}/v1/chat/completions"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def post(body: Any, headers: dict[str, str] = AUTH, path: str = url) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(path, content=content, headers={**headers, "Content-Type": "application/json"},
                          timeout=TIMEOUT_S)

    assert error_of(post(chat, {}), 401)["code"] == "invalid_api_key"
    assert error_of(post(chat, {"Authorization": "Bearer wrong-token-0123456789"}), 401)["code"] == "invalid_api_key"
    assert error_of(post(b"{oops"), 400)["type"] == "invalid_request_error"
    cases = [({"temperature": 5}, "temperature"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
             ({"top_p": "x"}, "top_p"), ({"logit_bias": {"x": 1}}, "logit_bias"), ({"tools": [{}]}, "tools[0].type"),
             ({"response_format": {"type": "xml"}}, "response_format"), ({"top_logprobs": 2}, "top_logprobs"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
              "messages[0].content[0].type"), ({"messages": []}, "messages"), ({"n": 0}, "n")]
    for extra, param in cases:
        error = error_of(post({**chat, **extra}), 400)
        assert (error["type"], error["param"]) == ("invalid_request_error", param), (extra, error)
        assert param.split("[")[0] in error["message"], error
    assert post({**chat, "some_future_field": 1}).status_code == 200  # unknown fields are ignored
    missing = error_of(post({**chat, "model": "gpt-4o"}), 404)
    assert (missing["code"], missing["param"]) == ("model_not_found", "model")
    long = error_of(post({**chat, "messages": [{"role": "user", "content": "hi " * 9000}]}), 400)
    assert (long["code"], long["param"]) == ("context_length_exceeded", "messages")
    prompt = error_of(post({"model": MODEL, "prompt": "hi " * 9000}, path=url.replace("chat/completions",
                                                                                    "completions")), 400)
    assert (prompt["code"], prompt["param"]) == ("context_length_exceeded", "prompt")


class _Unwell(EchoEngine):
    healthy = True

    def health(self) -> Health:
        return Health("ok") if self.healthy else Health("restarting", "model step failed")


def test_overload_unhealthy_and_disconnect_with_the_echo_engine() -> None:
    """429 with Retry-After, 503 while not healthy, and a client leaving mid-stream frees its request."""
    async def main() -> None:
        engine = _Unwell(token_delay_s=0.01, max_running=1, max_waiting=1)
        async with Server(engine, ServerConfig(token=TOKEN, port=0), "echo") as server:
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            body = {"model": "echo", "prompt": "a b c", "max_tokens": 100_000, "stream": True}
            async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
                async with http.stream("POST", url, json=body) as stream, http.stream("POST", url, json=body) as queued:
                    assert stream.status_code == queued.status_code == 200
                    lines = stream.aiter_lines()
                    first = json.loads((await anext(lines)).removeprefix("data: "))
                    assert first["object"] == "text_completion" and first["choices"][0]["text"] == "a"
                    busy = await http.post(url, json={**body, "stream": False, "max_tokens": 1})
                    error = error_of(busy, 429)
                    assert error["code"] == "rate_limit_exceeded" and int(busy.headers["Retry-After"]) >= 1
                deadline = time.monotonic() + 10  # the stream is closed: the engine must free the request
                while engine.num_free_blocks != engine.num_blocks or engine._running:
                    assert time.monotonic() < deadline, "the disconnected request still holds the engine"
                    await asyncio.sleep(0.02)
                assert server.openai.in_flight == 0
                done = await http.post(url, json={**body, "stream": False, "max_tokens": 3})
                assert done.json()["choices"][0]["text"] == "a b c"
                engine.healthy = False
                unwell = await http.post(url, json=body)
                assert error_of(unwell, 503)["code"] == "service_unavailable"
                metrics = (await http.get(f"http://127.0.0.1:{server.port}/metrics")).text
                assert "edgeinfer_time_to_first_token_seconds_count 1.0" in metrics
                assert 'edgeinfer_errors_total{code="rate_limit_exceeded"} 1.0' in metrics

    asyncio.run(asyncio.wait_for(main(), 60))


def test_fields_a_client_leaves_unset_take_the_generation_defaults() -> None:
    """The API names the fields the client set (not null), so the engine fills the rest with the
    model's defaults, then GENERATION_DEFAULTS, as for every front end."""
    from edgeinfer.core.sampling_params import with_model_defaults
    from transport.openai_schema import ChatRequest, given_fields, parse, sampling_params

    body = parse(ChatRequest, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                               "temperature": None, "top_p": 0.5, "max_completion_tokens": 3})
    filled = with_model_defaults(sampling_params(body), given_fields(body), {"top_k": 7})
    assert (filled.temperature, filled.top_p, filled.top_k, filled.max_tokens) == (0.7, 0.5, 7, 3)
    bare = parse(ChatRequest, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert with_model_defaults(sampling_params(bare), given_fields(bare), {}).max_tokens == 512
