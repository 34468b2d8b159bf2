"""Structured output over the OpenAI API (transport.openai_guide), driven by the official `openai`
client against a live server on the default model: response_format json_schema (and, slow,
json_object streamed, vLLM's guided_regex, guided_choice and guided_json), and a 400 naming the
parameter for what the grammar library cannot compile."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
from live_server import TOKEN, LiveServer

from edgeinfer.config import RuntimeConfig
from transport.service import open_engine

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
TIMEOUT_S = 120.0
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(default_model_path):  # noqa: ANN001, ANN201
    @contextlib.asynccontextmanager
    async def engine() -> AsyncIterator[Any]:
        async with open_engine(str(default_model_path), RuntimeConfig()) as (opened, _):
            yield opened

    server = LiveServer(engine, model_name=MODEL)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=TOKEN, timeout=TIMEOUT_S)
    server.close()


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0.8,
                                          seed=7, **kwargs)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    reply = ask(client, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


@pytest.mark.slow
def test_response_format_json_object_streamed(client: openai.OpenAI) -> None:
    streamed = ask(client, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_vllm_guided_extensions(client: openai.OpenAI) -> None:
    reply = ask(client, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert reply.choices[0].finish_reason == "stop"
    assert len(reply.choices[0].message.content) == 6 and reply.choices[0].message.content[3] == "-"
    reply = ask(client, n=3, extra_body={"guided_choice": ["yes", "no", 'it "depends"']})
    assert {c.message.content for c in reply.choices} <= {"yes", "no", 'it "depends"'}
    completion = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=20, temperature=0.8,
                                           extra_body={"guided_json": {"type": "array", "items": {"type": "integer"},
                                                                       "minItems": 2, "maxItems": 4}})
    answer = json.loads(completion.choices[0].text)
    assert 2 <= len(answer) <= 4 and all(isinstance(x, int) for x in answer)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", ["strin"]),
    ({"guided_regex": "a("}, "guided_regex", ["unclosed group"]),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", ["nowhere"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", ["schema"]),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", ["at most one"]),
    ({"guided_choice": []}, "guided_choice", ["non-empty"]),
])
def test_what_cannot_be_compiled_is_a_400_naming_the_parameter(client: openai.OpenAI, extra: dict[str, Any],
                                                              param: str, words: list[str]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, extra_body=extra)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"]
    for word in words:
        assert word in error["message"], error
