"""Structured output in the OpenAI API: `response_format` and vLLM's `guided_*` extensions mapped
onto SamplingParams.guide (edgeinfer.core.guides enforces it).

- response_format {"type": "text"}: no guide; {"type": "json_object"}: any JSON object;
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}: the schema,
  enforced whether strict is true or not (OpenAI's non-strict mode only tries).
- guided_json (a schema, as an object or a JSON string), guided_regex, guided_grammar (Lark or
  GBNF), guided_choice (a list of strings: the output is exactly one of them), as vLLM names them.

At most one of them per request. A guide the grammar library cannot compile comes back from the
engine as invalid_params and is answered with a 400 naming the parameter the client used.
"""

from __future__ import annotations

import json
from typing import Any

from transport.openai_schema import invalid

GUIDE_PARAMS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")


def guide_of(request: Any) -> tuple[tuple[str, str] | None, str | None]:
    """(SamplingParams.guide, the parameter it came from) of a parsed request; (None, None) for none."""
    given = [name for name in GUIDE_PARAMS if getattr(request, name, None) is not None]
    if len(given) > 1:
        raise invalid(given[1], f"give at most one of {', '.join(given)}")
    if not given:
        return None, None
    name = given[0]
    value = getattr(request, name)
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        return ("json_schema", value if isinstance(value, str) else json.dumps(value)), name
    if name == "guided_regex":
        return ("regex", value), name
    if name == "guided_grammar":
        return ("grammar", value), name
    if not value or not all(isinstance(c, str) and c for c in value):
        raise invalid(name, "guided_choice must be a non-empty list of non-empty strings")
    # A Lark grammar of string literals; JSON's escapes are Lark's.
    return ("grammar", "start: " + " | ".join(json.dumps(choice) for choice in value)), name


def _response_format(value: dict[str, Any]) -> tuple[tuple[str, str] | None, str]:
    kind = value.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return ("json_object", ""), "response_format"
    if kind != "json_schema":
        raise invalid("response_format", f"response_format.type must be text, json_object or json_schema, "
                                         f"got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise invalid("response_format", "response_format.json_schema must be an object with a schema object "
                                         '({"name": ..., "schema": {...}, "strict": true})')
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("response_format", "response_format.json_schema.strict must be true or false")
    return ("json_schema", json.dumps(spec["schema"])), "response_format"
