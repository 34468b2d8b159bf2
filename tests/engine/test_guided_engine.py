"""Structured output end to end on the real default model: guided requests sampled at T=0.8, many at
once, every answer parsed and validated with `jsonschema` (an independent validator). The full set
(50 requests over 12 schemas) is slow; a fast subset runs by default, with prompt-lookup
speculation on so that drafts verified under the grammar are exercised on a real model."""

from __future__ import annotations

import json
from typing import Any

import anyio
import jsonschema
import pytest

from edgeinfer.config import SchedulerConfig
from edgeinfer.core.events import Finished
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.engine.api import Engine, EngineConfig

pytestmark = pytest.mark.anyio
TIMEOUT_S = 600

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "shade": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["colour", "shade"], "additionalProperties": False},
    {"type": "object", "properties": {"city": NAME, "location": {
        "type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                         "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}},
     "required": ["city", "location"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {
        "type": "integer", "minimum": 1, "maximum": 10}, "minItems": 2, "maxItems": 5}},
     "required": ["scores"], "additionalProperties": False},
    {"type": "object", "properties": {"done": {"type": "boolean"}, "priority": {"enum": [1, 2, 3]},
                                      "title": NAME}, "required": ["done", "priority", "title"],
     "additionalProperties": False},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": NAME, "author": {"type": "object", "properties": {"first": NAME, "last": NAME},
                                  "required": ["first", "last"], "additionalProperties": False},
        "year": {"type": "integer", "minimum": 1450, "maximum": 2025}},
        "required": ["title", "author", "year"], "additionalProperties": False}},
     "required": ["book"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"sku": NAME, "qty": {
        "type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"temperature": {"type": "number", "exclusiveMinimum": -50,
                                                      "exclusiveMaximum": 60},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {
        "type": "integer", "minimum": 0, "maximum": 100}, "reason": NAME},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {
        "type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 2},
        "minItems": 2, "maxItems": 2}}, "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "roles": {"type": "array", "items": {
            "enum": ["admin", "editor", "viewer"]}, "maxItems": 3}},
        "required": ["id", "roles"], "additionalProperties": False}, "active": {"type": "boolean"}},
     "required": ["user", "active"], "additionalProperties": False},
]
TOPICS = ["a person", "a colour", "a city", "some tags", "test scores", "a task", "a book", "an order",
          "the weather", "an answer", "a matrix", "a user account"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def guided_answers(model_path: str, num_requests: int, **scheduler: Any) -> list[tuple[dict, Finished]]:
    """num_requests chat requests at T=0.8, request i guided by SCHEMAS[i % 12], all at once."""
    cfg = SchedulerConfig(**{"max_num_seqs": 16, **scheduler})
    answers: list[tuple[dict, Finished]] = []

    async def one(engine: Engine, i: int) -> None:
        schema = SCHEMAS[i % len(SCHEMAS)]
        question = f"Reply with JSON describing {TOPICS[i % len(TOPICS)]}."
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=200, seed=i,
                                guide=("json_schema", json.dumps(schema)))
        request = GenerateRequest(f"g{i}", messages=({"role": "user", "content": question},), params=params)
        events = [e async for e in engine.generate(request)]
        assert isinstance(events[-1], Finished), events[-1]
        answers.append((schema, events[-1]))

    with anyio.fail_after(TIMEOUT_S):
        async with Engine(EngineConfig(model_path, scheduler=cfg)) as engine, anyio.create_task_group() as tg:
            for i in range(num_requests):
                tg.start_soon(one, engine, i)
    return answers


def check(answers: list[tuple[dict, Finished]]) -> None:
    for schema, finished in answers:
        assert finished.finish_reason == "stop", finished
        jsonschema.validate(json.loads(finished.text), schema)


async def test_a_few_guided_requests_with_speculation_parse_and_validate(default_model_path) -> None:  # noqa: ANN001
    answers = await guided_answers(str(default_model_path), 3, speculative="ngram", speculate_max_seqs=4)
    check(answers)


@pytest.mark.slow
async def test_fifty_guided_requests_over_twelve_schemas_parse_and_validate(default_model_path) -> None:  # noqa: ANN001
    answers = await guided_answers(str(default_model_path), 50)
    assert len(answers) == 50 and len({json.dumps(s) for s, _ in answers}) == len(SCHEMAS)
    check(answers)
