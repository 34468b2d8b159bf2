"""The wire protocol "edgeinfer/1": parse client frames into typed messages, encode server events.

Pure functions and frozen plain-data messages; no I/O. The server owns connections and calls
`parse_frame` on every frame it receives and `encode` on every event it sends. docs/PROTOCOL.md
is the human-readable form of this module; keep the two in step.

A frame is one JSON object in a text frame or one msgpack map in a binary frame, same schema.
Anything a client can get wrong raises `ProtocolError(code, message, request_id)`: the server
answers it with an `error` event and keeps the connection (see `ProtocolError.fatal`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from edgeinfer.core.events import Accepted, Error, Event, Finished, PromptLogprobs, Token, TokenLogprob
from edgeinfer.core.sampling_params import InvalidParams, SamplingParams, given_fields

PROTOCOL_VERSION = "edgeinfer/1"
MAX_ID_CHARS = 128
MAX_DEPTH = 16  # a valid frame nests 4 deep (chat -> messages -> message -> content)
_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings whole, so brackets in them do not count
CHAT_ROLES = ("system", "user", "assistant")

# Stable protocol-level error codes (engine codes come from edgeinfer.core.events).
BAD_FRAME = "bad_frame"  # not JSON / msgpack, or not an object
FRAME_TOO_LARGE = "frame_too_large"
UNKNOWN_TYPE = "unknown_type"
UNKNOWN_FIELD = "unknown_field"
INVALID_MESSAGE = "invalid_message"  # a field missing or of the wrong type
UNSUPPORTED_VERSION = "unsupported_version"
UNAUTHORIZED = "unauthorized"
HELLO_REQUIRED = "hello_required"
DUPLICATE_ID = "duplicate_id"
UNKNOWN_ID = "unknown_id"
TOO_MANY_REQUESTS = "too_many_requests"
SHUTTING_DOWN = "shutting_down"
FATAL_CODES = frozenset({UNSUPPORTED_VERSION, UNAUTHORIZED, HELLO_REQUIRED})


class ProtocolError(Exception):
    """A client frame we cannot act on; `code` is stable, `message` names the field and value."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    @property
    def fatal(self) -> bool:
        """True when the connection cannot go on (it closes with code 1008 after the error)."""
        return self.code in FATAL_CODES


@dataclass(frozen=True)
class Hello:
    version: str
    token: str | None = None
    client: str | None = None  # free-form client name, for logs


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Generate:
    """A completion of `prompt` (text) or of `prompt_token_ids`; exactly one of them is set."""

    id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    params_given: frozenset[str] = frozenset()  # the fields the client set (the model's defaults fill the rest)


@dataclass(frozen=True)
class Chat:
    id: str
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    params_given: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Status:
    id: str | None = None  # None: every request of this connection


ClientMessage = Hello | Generate | Chat | Cancel | Status


# ---- parsing ------------------------------------------------------------------------------


def parse_frame(data: str | bytes, max_bytes: int) -> ClientMessage:
    """Decode and validate one client frame (str: JSON, bytes: msgpack). Raises ProtocolError."""
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > max_bytes:
        raise ProtocolError(FRAME_TOO_LARGE, f"frame of {size} bytes exceeds the limit of {max_bytes}")
    obj = _decode(data)
    _check_strings(obj)
    if not isinstance(obj, Mapping):
        raise ProtocolError(BAD_FRAME, f"a frame must be an object, got {_kind(obj)}")
    # The id first, so that every later error can name the request it belongs to.
    raw_id = obj.get("id")
    request_id = raw_id if isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_ID_CHARS else None
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(INVALID_MESSAGE, f"field 'type' must be a string, got {_kind(kind)}", request_id)
    parser = _PARSERS.get(kind)
    if parser is None:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {kind[:64]!r}; expected one of "
                            f"{', '.join(sorted(_PARSERS))}", request_id)
    allowed = _FIELDS[kind]
    unknown = sorted(str(k)[:64] for k in obj if k not in allowed)
    if unknown:
        raise ProtocolError(UNKNOWN_FIELD, f"unknown field(s) in {kind!r}: {', '.join(unknown)}", request_id)
    return parser(obj, request_id)


def _decode(data: str | bytes) -> Any:
    if isinstance(data, str):
        if not _json_depth_ok(data):
            raise ProtocolError(BAD_FRAME, f"text frame nests arrays/objects more than {MAX_DEPTH} deep")
        try:
            return json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise ProtocolError(BAD_FRAME, f"text frame is not valid JSON: {str(exc)[:200]}") from None
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise ProtocolError(BAD_FRAME, f"binary frame is not valid msgpack: {str(exc)[:200]}") from None


def _json_depth_ok(text: str) -> bool:
    """No array/object nested deeper than MAX_DEPTH, outside strings. Checked before decoding:
    json's decoder recurses, and a frame of 50,000 brackets exhausts the stack (RecursionError,
    and finalizers that the garbage collector runs at that depth fail too)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # the usual frame: no scan needed
        return True
    depth = 0
    for match in _JSON_NESTING.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif token in "]}":
            depth -= 1
    return True


def _check_strings(obj: Any) -> None:
    """Every string (keys too) must be valid Unicode: JSON's \\ud800 escapes decode to lone
    surrogates, which no UTF-8 frame can carry back (echoing one in an error would fail the
    connection) and no tokenizer takes. Also bounds the nesting of msgpack frames."""
    stack: list[tuple[str, Any, int]] = [("", obj, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth >= MAX_DEPTH and isinstance(value, (Mapping, list)):  # the root object is level 1
            raise ProtocolError(BAD_FRAME, f"the frame nests arrays/objects more than {MAX_DEPTH} deep")
        if isinstance(value, str):
            if not _is_unicode(value):
                raise ProtocolError(INVALID_MESSAGE, f"{_where(path)} is not valid Unicode (a lone surrogate "
                                    f"such as {_first_surrogate(value)}); strings must be Unicode scalar values")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if isinstance(key, str) and not _is_unicode(key):
                    raise ProtocolError(INVALID_MESSAGE, f"a field name in {_where(path)} is not valid Unicode "
                                        f"(a lone surrogate such as {_first_surrogate(key)})")
                stack.append((f"{path}.{key}" if path else str(key), item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_surrogate(text: str) -> str:
    return next(f"U+{ord(c):04X}" for c in text if 0xD800 <= ord(c) <= 0xDFFF)


def _where(path: str) -> str:
    return f"field {ascii(path)[1:-1][:80]!r}" if path else "the frame"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _require_id(obj: Mapping[str, Any], request_id: str | None) -> str:
    if request_id is None:
        raise ProtocolError(INVALID_MESSAGE, f"field 'id' must be a string of 1-{MAX_ID_CHARS} characters, "
                            f"got {_kind(obj.get('id'))}")
    return request_id


def _optional_str(obj: Mapping[str, Any], name: str, request_id: str | None) -> str | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise ProtocolError(INVALID_MESSAGE, f"field {name!r} must be a string, got {_kind(value)}",
                            request_id)
    return value


def _params(obj: Mapping[str, Any], request_id: str) -> SamplingParams:
    try:
        return SamplingParams.from_dict(obj.get("params") or {})
    except InvalidParams as exc:
        raise ProtocolError("invalid_params", str(exc), request_id) from None
    except (TypeError, ValueError, OverflowError) as exc:  # a value that defeats float()/int()
        raise ProtocolError("invalid_params", f"sampling parameters rejected: {exc}", request_id) from None


def _given(obj: Mapping[str, Any]) -> frozenset[str]:
    params = obj.get("params")  # already checked by _params
    return given_fields(params) if isinstance(params, Mapping) else frozenset()


def _parse_hello(obj: Mapping[str, Any], request_id: str | None) -> Hello:
    version = obj.get("version")
    if version != PROTOCOL_VERSION:
        shown = repr(version)[:64] if isinstance(version, str) else _kind(version)
        raise ProtocolError(UNSUPPORTED_VERSION,
                            f"protocol version must be {PROTOCOL_VERSION!r}, got {shown}")
    return Hello(version, _optional_str(obj, "token", None), _optional_str(obj, "client", None))


def _parse_generate(obj: Mapping[str, Any], request_id: str | None) -> Generate:
    rid = _require_id(obj, request_id)
    prompt, token_ids = obj.get("prompt"), obj.get("prompt_token_ids")
    if (prompt is None) == (token_ids is None):
        raise ProtocolError(INVALID_MESSAGE, "exactly one of 'prompt' and 'prompt_token_ids' is required",
                            rid)
    if prompt is not None and not (isinstance(prompt, str) and prompt):
        raise ProtocolError(INVALID_MESSAGE,
                            f"field 'prompt' must be a non-empty string, got {_kind(prompt)}", rid)
    if token_ids is not None:
        if not (isinstance(token_ids, list) and token_ids and all(_is_token_id(t) for t in token_ids)):
            raise ProtocolError(INVALID_MESSAGE, "field 'prompt_token_ids' must be a non-empty array of "
                                "non-negative integers", rid)
        token_ids = tuple(token_ids)
    return Generate(rid, _params(obj, rid), prompt, token_ids, _given(obj))


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _parse_chat(obj: Mapping[str, Any], request_id: str | None) -> Chat:
    rid = _require_id(obj, request_id)
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ProtocolError(INVALID_MESSAGE, f"field 'messages' must be a non-empty array, got {_kind(raw)}",
                            rid)
    messages = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping) or set(item) - {"role", "content"}:
            extra = sorted(str(k)[:64] for k in item) if isinstance(item, Mapping) else _kind(item)
            raise ProtocolError(INVALID_MESSAGE, f"messages[{i}] must be an object with 'role' and 'content' "
                                f"only, got {extra}", rid)
        role, content = item.get("role"), item.get("content")
        if role not in CHAT_ROLES:
            shown = repr(role)[:64] if isinstance(role, str) else _kind(role)
            raise ProtocolError(INVALID_MESSAGE,
                                f"messages[{i}].role must be one of {CHAT_ROLES}, got {shown}", rid)
        if not isinstance(content, str):
            raise ProtocolError(INVALID_MESSAGE,
                                f"messages[{i}].content must be a string, got {_kind(content)}", rid)
        messages.append(ChatMessage(role, content))
    return Chat(rid, tuple(messages), _params(obj, rid), _given(obj))


def _parse_cancel(obj: Mapping[str, Any], request_id: str | None) -> Cancel:
    return Cancel(_require_id(obj, request_id))


def _parse_status(obj: Mapping[str, Any], request_id: str | None) -> Status:
    if "id" in obj and obj["id"] is not None:
        _require_id(obj, request_id)
    return Status(request_id)


_PARSERS = {"hello": _parse_hello, "generate": _parse_generate, "chat": _parse_chat,
            "cancel": _parse_cancel, "status": _parse_status}
_FIELDS = {
    "hello": frozenset({"type", "version", "token", "client"}),
    "generate": frozenset({"type", "id", "prompt", "prompt_token_ids", "params"}),
    "chat": frozenset({"type", "id", "messages", "params"}),
    "cancel": frozenset({"type", "id"}),
    "status": frozenset({"type", "id"}),
}


# ---- server events ------------------------------------------------------------------------


def event_to_wire(event: Event, client_id: str) -> dict[str, Any]:
    """An engine event as a wire object; `client_id` replaces the engine's request id."""
    if isinstance(event, Accepted):
        return {"type": "accepted", "id": client_id, "queue_position": event.queue_position,
                "prompt_tokens": event.prompt_tokens}
    if isinstance(event, Token):
        wire: dict[str, Any] = {"type": "token", "id": client_id, "text": event.text,
                                "token_ids": list(event.token_ids), "time_s": event.time_s}
        if event.index:
            wire["index"] = event.index
        if event.logprobs is not None:
            wire["logprobs"] = _logprobs_to_wire(event.logprobs)
        return wire
    if isinstance(event, PromptLogprobs):
        return {"type": "prompt_logprobs", "id": client_id, "logprobs": _logprobs_to_wire(event.logprobs)}
    if isinstance(event, Finished):
        usage = event.usage
        wire = {"type": "done", "id": client_id, "finish_reason": event.finish_reason, "text": event.text,
                "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                          "cached_prompt_tokens": usage.cached_prompt_tokens},
                "ttft_s": usage.ttft_s, "tpot_s": usage.tpot_s, "queue_time_s": usage.queue_time_s,
                "total_time_s": usage.total_time_s, "kv_bytes": usage.peak_kv_bytes}
        if event.choices:
            wire["choices"] = [dict(c) for c in event.choices]
        return wire
    assert isinstance(event, Error), f"not an engine event: {event!r}"
    return error_to_wire(event.code, event.message, client_id, event.retry_after_s)


def _logprobs_to_wire(logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, p] for t, p in lp.top]} for lp in logprobs]


def error_to_wire(code: str, message: str, request_id: str | None = None,
                  retry_after_s: float | None = None) -> dict[str, Any]:
    wire: dict[str, Any] = {"type": "error", "id": request_id, "code": code, "message": message}
    if retry_after_s is not None:
        wire["retry_after_s"] = retry_after_s
    return wire


def encode(wire: Mapping[str, Any], binary: bool) -> str | bytes:
    """One wire object as a frame: msgpack bytes when binary, else JSON text."""
    if binary:
        return msgpack.packb(wire, use_bin_type=True)
    return json.dumps(_finite(wire), ensure_ascii=False, separators=(",", ":"))


def decode_event(data: str | bytes) -> dict[str, Any]:
    """A server frame back into a wire object (for clients)."""
    obj = json.loads(data) if isinstance(data, str) else msgpack.unpackb(data, raw=False)
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolError(BAD_FRAME, f"server frame is not an event object: {str(obj)[:200]}")
    return obj


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf (a -inf logprob is real); send them as null rather than invalid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
