"""The guide (SamplingParams.guide, enforced by constrained decoding in edgeinfer.core.guides) that
makes a model call a tool: for `tool_choice` "required" any of the tools, for a named function
that one. Each family's guide produces the syntax its template writes and transport.tool_calls
parses, with the arguments matching the tool's own JSON schema:
- generic: `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (a JSON schema);
- llama3: `{"name": ..., "parameters": {...}}` (a JSON schema; Llama 3 makes one call per turn);
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a Lark grammar embedding the
  schema). `[TOOL_CALLS]` is the tokenizer's control token where it has one, referenced by id
  since llguidance never lets text spell a special token, else plain text: either way what the
  template's own text becomes when it is tokenized;
- hermes: `<tool_call>\n{...}\n</tool_call>` once or more (a Lark grammar embedding the schema).
"""

from __future__ import annotations

import json
from typing import Any

from edgeinfer.models.tokenizer import Tokenizer

MISTRAL_CALLS = "[TOOL_CALLS]"


def tool_call_guide(family: str, tools: list[dict[str, Any]], tokenizer: Tokenizer, name: str | None = None,
                    parallel: bool = True) -> tuple[str, str]:
    """(kind, spec) forcing a call of `name`, or of any tool when None; at most one call unless parallel."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    arguments_key = "parameters" if family == "llama3" else "arguments"
    call = {"anyOf": [_call_schema(f, arguments_key) for f in chosen]}
    if family == "llama3":
        return "json_schema", json.dumps(call)
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
    if family == "mistral":  # the template writes "[TOOL_CALLS] [" before the calls
        return "grammar", f"start: {_literal(MISTRAL_CALLS, tokenizer)} \" \" calls\ncalls: %json {json.dumps(calls)}\n"
    if family == "generic":
        return "json_schema", json.dumps({"type": "object", "properties": {"tool_calls": calls},
                                          "required": ["tool_calls"], "additionalProperties": False})
    assert family == "hermes", family
    repeat = "+" if parallel else ""
    return "grammar", (f'start: (tool_call "\\n"?){repeat}\n'
                       'tool_call: "<tool_call>\\n" call "\\n</tool_call>"\n'
                       f"call: %json {json.dumps(call)}\n")


def _literal(text: str, tokenizer: Tokenizer) -> str:
    """`text` in a Lark grammar: the special token it is in this tokenizer, or the plain text."""
    token_id = tokenizer.backend.token_to_id(text)
    return f"<[{token_id}]>" if token_id is not None and token_id in tokenizer.special_ids else json.dumps(text)


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}
