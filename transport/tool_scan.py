"""The tool calls in a model's answer, read as it streams (for transport.tool_calls'
`ToolCallStream`): fed the text after a family's start marker in pieces, `CallScanner` follows
the family's frame around the calls (hermes `<tool_call>` tags, Llama 3's objects joined by ";",
Mistral's array, the generic `{"tool_calls": [...]}` or a bare call) and the JSON inside it one
character at a time, and says as `CallDelta`s what may be sent: a call's first delta (index, id,
name) once its name and the start of its arguments are known, then its arguments' text as it is
scanned. A fragment only ever holds text already known to lie inside the arguments value: the
arguments' closing `}` is told from a `}` in a string, or from the call's own `}`, by the nesting
and string state, never by guessing at what the text ends with.

A call's arguments are the model's own text of the arguments object (or the decoded text of a
JSON-string arguments value), not a re-serialisation, since that is what can be sent before the
object is complete. The scanner checks structure as it goes and fails on text that cannot be a
call; `well_formed` then checks the finished answer strictly (every value valid JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

_WS = re.compile(r"[ \t\n\r]*")
_STRING_BODY = re.compile(r'[^"\\]*')
_SCALAR = re.compile(r'[^,:\[\]{}"\s]*')
# The longest run of complete string tokens; group 1 is the last \u escape, to find a high
# surrogate whose low half has not arrived yet.
_DECODABLE = re.compile(r"(?:[^\\]+|(\\u[0-9a-fA-F]{4})|\\[^u])*")
_ARGUMENTS_KEYS = {"llama3": ("parameters", "arguments")}
_SKIPPED = -2  # a call past max_calls: scanned, never sent


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of a call: its first (id and name set, arguments "") or a fragment of
    its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class _Call:
    """A call object met by the scanner; positions are in the scanner's text, -1 while unknown."""

    start: int
    end: int = -1
    name: str | None = None
    args_key: str | None = None
    args_start: int = -1
    args_end: int = -1
    args_string: bool = False  # a JSON string holding the arguments object
    sent_to: int = -1  # the arguments text taken so far ends here
    pending: str = ""  # arguments taken but not yet sent (the call's first delta waits on its name)
    arguments: str = ""  # sent
    index: int = -1  # in the answer's calls once sent, or _SKIPPED
    id: str = ""


@dataclass(slots=True)
class _Frame:
    """An open object or array."""

    kind: str  # "{" or "["
    role: str
    state: str  # what may come next: "key0" / "key" / "colon" / "value" / "next", or "value0" / "value" / "next"
    start: int
    key: str | None = None  # the object's current key


class CallScanner:
    """Calls out of the text after a family's start marker, fed in pieces. Roles of JSON values:
    "call" (a call object), "calls" (an array of them), "generic_root" (a call or the generic
    wrapper, told by its first key), "wrapper", "name", "args", "inner" (anything else)."""

    def __init__(self, family: str, max_calls: int, new_id: Callable[[], str], tag: str = "<tool_call>") -> None:
        self.family, self.max_calls, self.new_id, self.tag = family, max_calls, new_id, tag
        self.args_keys = _ARGUMENTS_KEYS.get(family, ("arguments",))
        self.text = ""
        self.pos = 0
        self.state = "before"  # a root value is due; "root": inside one; "after" it; "done": ignore the rest
        self.mode = ""  # "string" or "scalar" while inside one (it may continue in the next piece)
        self.string_role = ""
        self.token_start = 0
        self.stack: list[_Frame] = []
        self.roots: list[tuple[int, int]] = []
        self.root_start = 0
        self.calls: list[_Call] = []
        self.call: _Call | None = None  # the open call (calls never nest)
        self.sent = 0
        self.failed = False
        self.out: list[CallDelta] = []

    def feed(self, text: str) -> list[CallDelta]:
        self.out = []
        if self.failed or self.state == "done":
            return self.out
        self.text += text
        while self.pos < len(self.text) and not self.failed and self.state != "done":
            before = (self.pos, self.state, self.mode)
            if self.mode == "string":
                self._string()
            elif self.mode == "scalar":
                self._scalar()
            elif self.state == "root":
                self._structure()
            elif self.state == "before":
                self._before()
            else:
                self._after()
            if (self.pos, self.state, self.mode) == before:  # the rest may be a tag cut in two: wait for more
                break
        if self.call is not None and not self.failed:
            self._emit(self.call)
        return self.out

    @property
    def well_formed(self) -> bool:
        """Every root closed and valid JSON, every call's name and arguments as scanned."""
        if self.failed or self.state not in ("after", "done") or not self.calls:
            return False
        try:
            for start, end in self.roots:
                json.loads(self.text[start:end])
            for call in self.calls:
                obj = json.loads(self.text[call.start:call.end])
                if obj.get("name") != call.name:
                    return False
                value = obj[call.args_key] if call.args_key else {}
                arguments = json.loads(value) if isinstance(value, str) else value
                if not isinstance(arguments, dict):
                    return False
                if call.index >= 0:  # sent: the arguments sent are these
                    sent = call.arguments if isinstance(value, str) else json.loads(call.arguments)
                    if sent != value:
                        return False
        except (ValueError, KeyError):
            return False
        return True

    def _fail(self) -> None:
        self.failed = True

    # ---- the frame around the JSON ---------------------------------------------------------

    def _before(self) -> None:
        pos = _WS.match(self.text, self.pos).end()
        self.pos = pos
        if pos == len(self.text):
            return
        c = self.text[pos]
        if c == "{":
            role = "generic_root" if self.family == "generic" else "call"
        elif c == "[" and self.family == "mistral":
            role = "calls"
        else:
            self._fail()
            return
        self.state, self.root_start = "root", pos
        self._value(c, role)

    def _after(self) -> None:
        text = self.text
        if self.family == "hermes":  # the next call's tag; anything between calls is skipped
            at = text.find(self.tag, self.pos)
            if at < 0:
                self.pos = max(self.pos, len(text) - len(self.tag) + 1)
            else:
                self.pos, self.state = at + len(self.tag), "before"
            return
        pos = _WS.match(text, self.pos).end()
        self.pos = pos
        if pos == len(text):
            return
        if self.family == "llama3" and text[pos] == ";":
            self.pos += 1
        elif self.family == "llama3" and text[pos] == "{":
            self.state = "before"
        else:
            self.state = "done"

    # ---- JSON ------------------------------------------------------------------------------

    def _structure(self) -> None:
        pos = _WS.match(self.text, self.pos).end()
        self.pos = pos
        if pos == len(self.text):
            return
        c, frame = self.text[pos], self.stack[-1]
        state = frame.state
        if frame.kind == "{":
            if state in ("key0", "key") and c == '"':
                self._open_string("key")
            elif (state == "key0" or state == "next") and c == "}":
                self._close()
            elif state == "colon" and c == ":":
                frame.state, self.pos = "value", pos + 1
            elif state == "value":
                frame.state = "next"
                self._value(c, self._child_role(frame))
            elif state == "next" and c == ",":
                frame.state, self.pos = "key", pos + 1
            else:
                self._fail()
        elif (state == "value0" or state == "next") and c == "]":
            self._close()
        elif state in ("value0", "value"):
            frame.state = "next"
            self._value(c, "call" if frame.role == "calls" else "inner")
        elif state == "next" and c == ",":
            frame.state, self.pos = "value", pos + 1
        else:
            self._fail()

    def _child_role(self, frame: _Frame) -> str:
        call = self.call
        if frame.role == "call" and call is not None:
            if frame.key == "name" and call.name is None:
                return "name"
            if frame.key in self.args_keys and call.args_key is None:
                call.args_key = frame.key
                return "args"
        if frame.role == "wrapper" and frame.key == "tool_calls":
            return "calls"
        return "inner"

    def _value(self, c: str, role: str) -> None:
        wanted = {"call": "{", "generic_root": "{", "calls": "[", "name": '"', "args": '{"'}.get(role)
        if wanted is not None and c not in wanted:
            self._fail()
            return
        pos = self.pos
        if role == "args":
            assert self.call is not None
            self.call.args_start, self.call.args_string = pos, c == '"'
            self.call.sent_to = pos + (c == '"')
        if c in "{[":
            self.stack.append(_Frame(c, role, "key0" if c == "{" else "value0", pos))
            self.pos = pos + 1
            if role == "call":
                self._start_call(pos)
        elif c == '"':
            self._open_string(role)
        elif c in ",:]}":
            self._fail()
        else:
            self.mode = "scalar"
            self._scalar()

    def _start_call(self, start: int) -> None:
        self.call = _Call(start)
        self.calls.append(self.call)

    def _close(self) -> None:
        frame = self.stack.pop()
        self.pos += 1
        call = self.call
        if frame.role == "args" and call is not None:
            call.args_end = self.pos
        elif frame.role == "call" and call is not None:
            call.end = self.pos
            if call.name is None:
                self._fail()
                return
            self._emit(call)
            self.call = None
        elif frame.role == "generic_root":  # `{}`: no call
            self._fail()
        if not self.stack:
            self.roots.append((self.root_start, self.pos))
            self.state = "after"

    def _open_string(self, role: str) -> None:
        self.mode, self.string_role, self.token_start = "string", role, self.pos
        self.pos += 1
        self._string()

    def _string(self) -> None:
        text = self.text
        while True:
            pos = _STRING_BODY.match(text, self.pos).end()
            if pos == len(text):
                self.pos = pos
                return
            if text[pos] == "\\":
                if pos + 1 == len(text):  # the escaped character is still to come
                    self.pos = pos
                    return
                self.pos = pos + 2
                continue
            self.pos, self.mode = pos + 1, ""
            self._string_done(text[self.token_start:self.pos])
            return

    def _string_done(self, raw: str) -> None:
        role, call = self.string_role, self.call
        if role == "key":
            frame = self.stack[-1]
            try:
                frame.key = json.loads(raw)
            except ValueError:
                self._fail()
                return
            frame.state = "colon"
            if frame.role == "generic_root":  # a bare call, or the wrapper of a list of calls
                frame.role = "wrapper" if frame.key == "tool_calls" else "call"
                if frame.role == "call":
                    self._start_call(frame.start)
        elif role == "name" and call is not None:
            try:
                call.name = json.loads(raw)
            except ValueError:
                self._fail()
        elif role == "args" and call is not None:
            call.args_end = self.pos

    def _scalar(self) -> None:
        self.pos = _SCALAR.match(self.text, self.pos).end()
        if self.pos < len(self.text):
            self.mode = ""

    # ---- sending ---------------------------------------------------------------------------

    def _emit(self, call: _Call) -> None:
        """Send what is new of this call: its first delta once it is known to be a call, then the
        arguments text scanned since the last piece."""
        if call.index == _SKIPPED:
            return
        call.pending += self._take_arguments(call)
        if self.failed:
            return
        if call.index < 0:
            if call.name is None:
                return
            if call.args_string:  # the decoded string must hold an object
                head = call.pending.lstrip()
                if not head and call.args_end < 0:
                    return
                if not head.startswith("{"):
                    self._fail()
                    return
            elif call.args_start < 0 and call.end < 0:
                return
            if self.sent >= self.max_calls:
                call.index = _SKIPPED
                return
            call.index, call.id = self.sent, self.new_id()
            self.sent += 1
            self.out.append(CallDelta(call.index, "", call.id, call.name))
        if call.pending:
            self.out.append(CallDelta(call.index, call.pending))
            call.arguments += call.pending
            call.pending = ""

    def _take_arguments(self, call: _Call) -> str:
        if call.args_start < 0:  # no arguments key: `{}`, once the call has closed without one
            return "{}" if call.end >= 0 and not call.arguments and not call.pending else ""
        end = call.args_end if call.args_end >= 0 else self.pos
        if not call.args_string:
            taken, call.sent_to = self.text[call.sent_to:end], end
            return taken
        closed = call.args_end >= 0
        end -= closed  # the closing quote
        match = _DECODABLE.match(self.text, call.sent_to, end)
        cut = match.end()
        if closed and cut != end:
            self._fail()
            return ""
        escape = match.group(1)
        if not closed and escape and match.end(1) == cut and escape[2] in "dD" and escape[3] in "89abAB":
            cut = match.start(1)  # a high surrogate: decode it with its low half
        try:
            taken = json.loads('"' + self.text[call.sent_to:cut] + '"', strict=False)
        except ValueError:
            self._fail()
            return ""
        call.sent_to = cut
        return taken
