"""Tool calls for the OpenAI API: which call syntax a chat template speaks (its family), the chat
and tools made ready for that template, the model's calls parsed out of its text (whole or as it
streams), and the guide that forces a call for `tool_choice` "required" or a named function.

Families, told apart by the template's own text:
- "hermes" (Qwen2.5, Hermes, ...): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
  anywhere in the answer, several allowed; text before the first call is content.
- "llama3" (Llama 3.1 / 3.2): the whole answer is `{"name": ..., "parameters": {...}}`, perhaps
  after `<|python_tag|>`.
- "mistral" (v0.3 templates with `[AVAILABLE_TOOLS]`): `[TOOL_CALLS] [{"name": ..., "arguments":
  {...}}, ...]` (the control token is dropped from decoded text, so a bare leading array counts).
- "generic": a template with no tool syntax (the default model's ChatML). The tools are described
  in a system message and the model answers `{"tool_calls": [{"name": ..., "arguments": {...}}]}`,
  so tools work on every model.
Native families get the tools through the template's `tools` variable, as transformers'
`apply_chat_template(tools=...)` passes them. Parsing is lenient in what it skips (whitespace,
text after the calls) and strict in what it returns: a call is an object with a string name and
object (or JSON-string) arguments, else the text stays content. Hand-written rather than taken
from vLLM's tool parsers, which would bring vLLM itself.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

FAMILIES = ("hermes", "llama3", "mistral", "generic")
# Where a call may begin: anywhere (hermes) or only at the start of the answer (the others). A
# start marker that is a single character ("{", "[") decides early: plain text held for it is
# released as soon as it cannot be a call.
_MARKERS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>", "{"),
            "mistral": ("[TOOL_CALLS]", "["), "generic": ("{",)}
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's id, the function's name, its arguments as a JSON string."""

    id: str
    name: str
    arguments: str


def template_family(chat_template: str | None) -> str:
    """The family whose call syntax the template renders; "generic" when it renders none."""
    text = chat_template or ""
    if "tools" not in text:
        return "generic"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if "<|start_header_id|>" in text and '"parameters"' in text:
        return "llama3"
    return "generic"


def new_call_id(family: str) -> str:
    """A fresh call id; Mistral's templates refuse any id that is not 9 letters and digits."""
    if family == "mistral":
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def prepare_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 family: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the template. Assistant calls' arguments become objects (templates
    `tojson` them). A native family gets the tools as they are; the generic one gets them in a
    system message, its past calls written in its JSON format and tool results as user turns."""
    messages = [_with_object_arguments(m) for m in messages]
    if family != "generic":
        return messages, tools
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append({"role": "assistant", "content": ((message.get("content") or "") + "\n" + text).lstrip()})
        elif message["role"] == "tool":
            label = f" {message['name']}" if message.get("name") else ""
            out.append({"role": "user", "content": f"Result of tool call{label} {message.get('tool_call_id', '')}:"
                                                   f"\n{message.get('content') or ''}"})
        else:
            out.append(message)
    if tools:
        described = _generic_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # a client's malformed arguments are rendered as the string they sent
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


def _generic_system_text(tools: list[dict[str, Any]]) -> str:
    lines = ["You can call these tools (JSON schemas of their arguments):"]
    for tool in tools:
        function = tool["function"]
        lines.append(json.dumps({"name": function["name"], "description": function.get("description", ""),
                                 "parameters": function.get("parameters", {"type": "object"})}, ensure_ascii=False))
    lines.append('To call tools, answer with only this JSON and nothing else: {"tool_calls": [{"name": '
                 '<tool name>, "arguments": <arguments object>}]}. Otherwise answer normally.')
    return "\n".join(lines)


class ToolCallStream:
    """Splits a streaming answer into content (released as soon as it cannot start a call) and
    calls (held until the answer ends, then parsed). One per choice."""

    def __init__(self, family: str) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown tool call family {family!r} (one of {', '.join(FAMILIES)})")
        self.family = family
        self._markers = _MARKERS[family]
        self._anywhere = family == "hermes"
        self._held = ""
        self._state = "undecided"  # -> "content" (no call possible) or "call" (buffering to the end)

    def push(self, text: str) -> str:
        """The content that may be sent now."""
        self._held += text
        if self._state == "call":
            return ""
        if self._anywhere:
            return self._push_anywhere()
        if self._state == "undecided":
            start = self._held.lstrip()
            if not start or any(m.startswith(start) for m in self._markers):
                return ""  # may still become a call
            if any(start.startswith(m) for m in self._markers):
                self._state = "call"
                return ""
            self._state = "content"
        out, self._held = self._held, ""
        return out

    def _push_anywhere(self) -> str:
        marker = self._markers[0]
        at = self._held.find(marker)
        if at >= 0:
            out, self._held, self._state = self._held[:at], self._held[at:], "call"
            return out
        keep = next((k for k in range(min(len(marker) - 1, len(self._held)), 0, -1)
                     if marker.startswith(self._held[-k:])), 0)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still held, the calls) once the answer has ended."""
        held, self._held = self._held, ""
        if self._state != "call":
            return held, []
        calls = _parse_calls(held, self.family)
        if not calls:
            return held, []
        return "", [ToolCall(new_call_id(self.family), name, arguments) for name, arguments in calls]


def parse_tool_calls(text: str, family: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer; no calls: the text is all content."""
    stream = ToolCallStream(family)
    content = stream.push(text)
    rest, calls = stream.finish()
    return content + rest, calls


def _parse_calls(text: str, family: str) -> list[tuple[str, str]]:
    """(name, arguments JSON) of each call in held text that begins with the family's marker."""
    decoder = json.JSONDecoder()
    text = text.strip()
    found: list[Any] = []
    try:
        if family == "hermes":
            for part in text.split("<tool_call>")[1:]:
                obj, _ = decoder.raw_decode(part.strip())
                found.append(obj)
        elif family == "llama3":
            text = text.removeprefix("<|python_tag|>").strip()
            while text:  # several calls come separated by ";"
                obj, end = decoder.raw_decode(text)
                found.append(obj)
                text = text[end:].strip().removeprefix(";").strip()
                if not text.startswith("{"):
                    break
        elif family == "mistral":
            obj, _ = decoder.raw_decode(text.removeprefix("[TOOL_CALLS]").strip())
            found = obj if isinstance(obj, list) else [obj]
        else:  # the wrapper asked for, or a bare call as small models often write it
            obj, _ = decoder.raw_decode(text)
            found = obj.get("tool_calls", [obj] if "name" in obj else None) if isinstance(obj, dict) else None
            if not isinstance(found, list):
                return []
    except ValueError:
        return []
    calls = []
    for obj in found:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        arguments = obj.get("parameters" if family == "llama3" and "parameters" in obj else "arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return []
        if not isinstance(arguments, dict):
            return []
        calls.append((obj["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls
