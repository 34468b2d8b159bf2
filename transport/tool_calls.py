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
`apply_chat_template(tools=...)` passes them. `ToolCallStream` streams calls as OpenAI does (a
call's name, then its arguments' text in fragments as the model writes it; transport.tool_scan
reads the calls); `parse_tool_calls` takes a whole answer through the same path, so the two give
the same arguments: the model's own text of the arguments object. Parsing is lenient in what it
skips (whitespace, text after the calls) and strict in what it returns: a call is an object with a
string name and object (or JSON-string) arguments, else the text stays content (a stream that has
sent a call cannot take it back). Hand-written rather than taken from vLLM's tool parsers, which
would bring vLLM itself.
"""

from __future__ import annotations

import json
import secrets
import string
import sys
from dataclasses import dataclass
from typing import Any

from transport.tool_scan import CallDelta, CallScanner

FAMILIES = ("hermes", "llama3", "mistral", "generic")
# Where a call may begin: anywhere (hermes) or only at the start of the answer (the others). A
# start marker that is a single character ("{", "[") decides early: plain text held for it is
# released as soon as it cannot be a call.
MARKERS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>", "{"),
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
    """Splits one choice's answer, as it streams, into content (released as soon as it cannot
    start a call) and call deltas in OpenAI's streaming shape (transport.tool_scan). A call is
    sent as soon as it starts; an answer that turns malformed after that (cut by max_tokens,
    broken JSON) keeps what was sent, as OpenAI's own streams do, and `complete` is False."""

    def __init__(self, family: str, max_calls: int | None = None) -> None:
        if family not in FAMILIES:
            raise ValueError(f"unknown tool call family {family!r} (one of {', '.join(FAMILIES)})")
        self.family = family
        self._markers = MARKERS[family]
        self._max_calls = sys.maxsize if max_calls is None else max_calls
        self._held = ""  # content, unless it turns out to be calls
        self._state = "undecided"  # -> "content" (no call possible) or "calls" (scanning them)
        self._scanner: CallScanner | None = None

    @property
    def calls(self) -> list[ToolCall]:
        """The calls sent so far, each with the arguments sent so far."""
        if self._scanner is None:
            return []
        return [ToolCall(c.id, c.name or "", c.arguments) for c in self._scanner.calls if c.index >= 0]

    @property
    def complete(self) -> bool:
        """Whether the answer pushed so far is calls, each well formed to its end."""
        return self._scanner is not None and self._scanner.sent > 0 and self._scanner.well_formed

    def push(self, text: str) -> tuple[str, list[CallDelta]]:
        """(the content that may be sent now, the call deltas to send after it)."""
        if self._state == "calls":
            assert self._scanner is not None
            if not self._scanner.sent:
                self._held += text
            return self._scan(text, "")
        if self._state == "content":
            return text, []
        self._held += text
        if self.family == "hermes":
            return self._push_anywhere()
        start = self._held.lstrip()
        if not start or any(m.startswith(start) for m in self._markers):
            return "", []  # may still become a call
        marker = next((m for m in self._markers if start.startswith(m)), None)
        if marker is None:
            self._state = "content"
            out, self._held = self._held, ""
            return out, []
        # A one-character marker ("{", "[") is the call's own first character.
        return self._start(start[len(marker):] if len(marker) > 1 else start, "")

    def _push_anywhere(self) -> tuple[str, list[CallDelta]]:
        marker = self._markers[0]
        at = self._held.find(marker)
        if at >= 0:
            content, self._held = self._held[:at], self._held[at:]
            return self._start(self._held[len(marker):], content)
        keep = next((k for k in range(min(len(marker) - 1, len(self._held)), 0, -1)
                     if marker.startswith(self._held[-k:])), 0)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out, []

    def _start(self, call_text: str, content: str) -> tuple[str, list[CallDelta]]:
        self._state = "calls"
        self._scanner = CallScanner(self.family, self._max_calls, lambda: new_call_id(self.family),
                                    self._markers[0])
        return self._scan(call_text, content)

    def _scan(self, text: str, content: str) -> tuple[str, list[CallDelta]]:
        scanner = self._scanner
        assert scanner is not None
        deltas = scanner.feed(text)
        if scanner.sent:
            self._held = ""  # calls now: nothing held goes back to content
        elif scanner.failed:  # not a call after all, and the rest of the answer is content too
            content, self._held, self._state = content + self._held, "", "content"
        return content, deltas

    def finish(self) -> str:
        """The content still held once the answer has ended: held text that never became a call."""
        held, self._held = self._held, ""
        return held


def parse_tool_calls(text: str, family: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer, through the same scanner as a stream, so the arguments
    are those a stream sends; strict: unless every call is well formed, the text is all content."""
    stream = ToolCallStream(family, max_calls)
    content, _ = stream.push(text)
    content += stream.finish()
    if not stream.calls:
        return content, []
    if not stream.complete:
        return text, []
    return content, stream.calls
