"""Tool calls through the OpenAI API, driven by the official `openai` client: the response and
stream shapes on the echo engine (deterministic: it answers with the last message's words, so a
message holding a call in the generic format comes back as that call) with the API key and
browser Origin rules, `tool_choice` "required"
and a named function on the default model (every answer a call whose arguments validate against
the tool's schema), a tool-calling history through the template, and the API key."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from echo_engine import EchoEngine
from live_server import MODEL, TOKEN, LiveServer, serve_model
from openai.lib.streaming.chat import ChatCompletionStreamState

from transport.server import Server, ServerConfig

TIMEOUT_S = 1200.0  # a loaded 2-core machine: guided decoding of 20 requests takes minutes
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_calls_in_openais_shape_whole_and_streamed_on_the_echo_engine() -> None:
    call = json.dumps({"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}},
                                      {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]})
    messages = [{"role": "user", "content": call}]

    async def main() -> None:
        config = ServerConfig(token=TOKEN, port=0, api_keys=("sk-local-key",))
        async with Server(EchoEngine(), config, "echo") as server:
            base = f"http://127.0.0.1:{server.port}/v1"
            client = openai.AsyncOpenAI(base_url=base, api_key="sk-local-key", timeout=30)
            kwargs: dict[str, Any] = {"model": "echo", "messages": messages, "tools": TOOLS,
                                      "max_tokens": len(call.split())}
            whole = (await client.chat.completions.create(**kwargs)).choices[0]
            assert whole.finish_reason == "tool_calls" and whole.message.content is None
            calls = whole.message.tool_calls
            assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
                ("function", "add", {"a": 2, "b": 3}), ("function", "get_weather", {"city": "Oslo", "unit": "c"})]
            assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
            chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert "".join(d.content or "" for d in deltas) == ""
            fragments: dict[int, list[str]] = {}
            for d in deltas:
                for tc in d.tool_calls or ():
                    if tc.id:  # a call's first delta: its name, no arguments yet
                        assert tc.index not in fragments and tc.type == "function" and tc.function.name
                        assert tc.function.arguments == ""
                        fragments[tc.index] = []
                    else:
                        assert tc.id is None and tc.function.name is None and tc.function.arguments
                        fragments[tc.index].append(tc.function.arguments)
            assert list(fragments) == [0, 1] and all(len(f) > 1 for f in fragments.values())  # as they come
            state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
            for chunk in chunks:
                state.handle_chunk(chunk)
            accumulated = state.get_final_completion().choices[0].message.tool_calls
            assert [(c.function.name, c.function.arguments) for c in accumulated] == [
                (c.function.name, c.function.arguments) for c in calls]  # the same text, not just the same JSON
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
                "tool_calls"]
            # Plain text with tools on: content, as it streams; tool_choice none: never parsed.
            plain = await client.chat.completions.create(**{**kwargs, "max_tokens": 3, "messages": [
                {"role": "user", "content": "a b c"}]})
            assert plain.choices[0].message.content == "a b c" and plain.choices[0].message.tool_calls is None
            off = await client.chat.completions.create(**kwargs, tool_choice="none")
            assert off.choices[0].message.tool_calls is None and off.choices[0].message.content
            # Wrong key: 401 in OpenAI's shape; the server's token is a key too.
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(base_url=base, api_key="sk-wrong-key", timeout=30).models.list()
            assert (await openai.AsyncOpenAI(base_url=base, api_key=TOKEN, timeout=30).models.list()).data
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"http://127.0.0.1:{server.port}/healthz")).status_code == 200
                assert (await http.get(f"{base}/models")).json()["error"]["code"] == "invalid_api_key"
                # Browsers: the websocket's Origin rule (only the server's own page).
                key = {"Authorization": "Bearer sk-local-key"}
                evil = await http.get(f"{base}/models", headers={**key, "Origin": "http://evil.example"})
                assert evil.status_code == 403 and evil.json()["error"]["code"] == "forbidden_origin"
                own = await http.get(f"{base}/models", headers={**key, "Origin": f"http://127.0.0.1:{server.port}"})
                assert own.status_code == 200
                bad = await http.post(f"{base}/chat/completions", json={**kwargs, "tool_choice": {
                    "type": "function", "function": {"name": "nope"}}}, headers={"Authorization": f"Bearer {TOKEN}"})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
                both = await http.post(f"{base}/chat/completions", json={
                    **kwargs, "tool_choice": "required", "response_format": {"type": "json_object"}},
                    headers={"Authorization": f"Bearer {TOKEN}"})
                assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice"

    asyncio.run(asyncio.wait_for(main(), 60))


def test_api_key_is_validated_as_the_user_typed_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """From --api-key or $EDGEINFER_API_KEY, refused before the model loads, naming the option."""
    from edgeinfer.cli.serve import serve_main

    monkeypatch.setenv("EDGEINFER_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("EDGEINFER_API_KEY", "short")
    assert serve_main(["--port", "0"]) == 2
    assert "--api-key must be at least 8 characters" in capsys.readouterr().err
    assert serve_main(["--port", "0", "--api-key", " padded-key "]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_step_token_budget_below_the_batch_is_refused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--max-num-batched-tokens must leave every running sequence a token per step; refused before
    the model loads, with both figures."""
    from edgeinfer.cli.serve import serve_main

    monkeypatch.setenv("EDGEINFER_CONFIG_DIR", str(tmp_path))
    assert serve_main(["--port", "0", "--max-num-batched-tokens", "16"]) == 2
    assert "max_num_batched_tokens (16) must be >= max_num_seqs (64)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def live(default_model_path):  # noqa: ANN001, ANN201
    server = serve_model(default_model_path)
    yield server
    server.close()


@pytest.mark.parametrize("num_requests", [2, pytest.param(20, marks=pytest.mark.slow)])
def test_tool_choice_required_gives_a_valid_call_on_every_request(live: LiveServer, num_requests: int) -> None:
    """One call per answer (parallel_tool_calls false): with parallel calls allowed the grammar
    lets a 135M model append calls until max_tokens, a choice of the model's, not the server's."""
    questions = ["What is the weather in Paris?", "Add 12 and 30.", "Is it raining in Tokyo?", "What is 7 plus 8?",
                 "Weather in Lima, in fahrenheit please.", "Sum 100 and -1."]

    async def main() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key=TOKEN, timeout=TIMEOUT_S)
        requests = []
        for i in range(num_requests):
            choice: Any = "required" if i % 4 else {"type": "function", "function": {"name": "add"}}
            requests.append(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": questions[i % len(questions)]}], tools=TOOLS,
                tool_choice=choice, max_tokens=64, temperature=0.7, seed=i, parallel_tool_calls=False))
        replies = await asyncio.gather(*requests)
        await client.close()
        return replies

    replies = asyncio.run(asyncio.wait_for(main(), 1200))
    for i, reply in enumerate(replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice)
        calls = choice.message.tool_calls
        assert calls and len(calls) == 1, (i, calls)
        for call in calls:
            assert call.function.name in SCHEMAS and (i % 4 or call.function.name == "add"), (i, call)
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_tool_calling_history_renders_and_answers(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key=TOKEN, timeout=TIMEOUT_S)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": -3, "sky": "snow"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 100  # the tools and the call's result reached the prompt
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=MODEL, messages=[*messages[:2], {"role": "tool", "content": "x"}],
                                       max_tokens=2)
