"""transport.protocol: frames parse into typed messages or a ProtocolError naming the problem."""

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.core.events import Accepted, Error, Finished, PromptLogprobs, Token, TokenLogprob, Usage
from transport import protocol as wire

MAX = 1 << 16


def parse(obj, binary=False):
    frame = msgpack.packb(obj) if binary else json.dumps(obj)
    return wire.parse_frame(frame, MAX)


def error_of(frame) -> wire.ProtocolError:
    with pytest.raises(wire.ProtocolError) as info:
        wire.parse_frame(frame, MAX) if isinstance(frame, (str, bytes)) else parse(frame)
    return info.value


@pytest.mark.parametrize("binary", [False, True])
def test_valid_messages_parse_the_same_from_json_and_msgpack(binary):
    hello = parse({"type": "hello", "version": "edgeinfer/1", "token": "t" * 20}, binary)
    assert hello == wire.Hello("edgeinfer/1", "t" * 20)
    params = {"max_tokens": 4, "temperature": 0}
    gen = parse({"type": "generate", "id": "a", "prompt": "Hi", "params": params}, binary)
    assert gen.id == "a" and gen.prompt == "Hi" and gen.params.max_tokens == 4 and gen.params.is_greedy
    ids = parse({"type": "generate", "id": "b", "prompt_token_ids": [1, 2, 3]}, binary)
    assert ids.prompt_token_ids == (1, 2, 3) and ids.prompt is None
    chat = parse({"type": "chat", "id": "c", "messages": [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Hi"}]}, binary)
    assert chat.messages == (wire.ChatMessage("system", "Be brief."), wire.ChatMessage("user", "Hi"))
    assert parse({"type": "cancel", "id": "c"}, binary) == wire.Cancel("c")
    assert parse({"type": "status"}, binary) == wire.Status(None)
    assert parse({"type": "status", "id": "a"}, binary) == wire.Status("a")


@pytest.mark.parametrize("frame, code, words", [
    ("{not json", wire.BAD_FRAME, "not valid JSON"),
    (b"\xc1", wire.BAD_FRAME, "not valid msgpack"),
    ("[1, 2]", wire.BAD_FRAME, "must be an object, got array"),
    ('{"type": "generate", "id": "x", "prompt": NaN}', wire.BAD_FRAME, "NaN"),
    ('{"id": "x"}', wire.INVALID_MESSAGE, "'type' must be a string"),
    ('{"type": "launch", "id": "x"}', wire.UNKNOWN_TYPE, "'launch'"),
    ('{"type": "cancel", "id": "x", "force": true}', wire.UNKNOWN_FIELD, "force"),
    ('{"type": "cancel"}', wire.INVALID_MESSAGE, "'id'"),
    ('{"type": "cancel", "id": ""}', wire.INVALID_MESSAGE, "'id'"),
    ('{"type": "generate", "id": "x"}', wire.INVALID_MESSAGE, "exactly one of"),
    ('{"type": "generate", "id": "x", "prompt": "a", "prompt_token_ids": [1]}', wire.INVALID_MESSAGE,
     "exactly"),
    ('{"type": "generate", "id": "x", "prompt": 5}', wire.INVALID_MESSAGE, "'prompt'"),
    ('{"type": "generate", "id": "x", "prompt_token_ids": [1, -2]}', wire.INVALID_MESSAGE,
     "prompt_token_ids"),
    ('{"type": "generate", "id": "x", "prompt_token_ids": [true]}', wire.INVALID_MESSAGE, "prompt_token_ids"),
    ('{"type": "chat", "id": "x", "messages": []}', wire.INVALID_MESSAGE, "'messages'"),
    ('{"type": "chat", "id": "x", "messages": [{"role": "bot", "content": "a"}]}', wire.INVALID_MESSAGE,
     "messages[0].role"),
    ('{"type": "chat", "id": "x", "messages": [{"role": "user", "content": 1}]}', wire.INVALID_MESSAGE,
     "messages[0].content"),
    ('{"type": "chat", "id": "x", "messages": [{"role": "user", "content": "a", "name": "b"}]}',
     wire.INVALID_MESSAGE, "name"),
    ('{"type": "generate", "id": "x", "prompt": "a", "params": {"temprature": 1}}', "invalid_params",
     "temprature"),
    ('{"type": "generate", "id": "x", "prompt": "a", "params": {"top_p": 2}}', "invalid_params", "top_p"),
    ('{"type": "generate", "id": "x", "prompt": "a", "params": {"max_tokens": "9"}}', "invalid_params",
     "max_tokens"),
    ('{"type": "generate", "id": "x", "prompt": "a", "params": [1]}', "invalid_params", "object"),
    ('{"type": "hello", "version": "edgeinfer/0"}', wire.UNSUPPORTED_VERSION, "edgeinfer/0"),
    ('{"type": "hello", "version": "edgeinfer/1", "token": 5}', wire.INVALID_MESSAGE, "'token'"),
    # Lone surrogates (JSON escapes decode to them) in an id, a field name, a prompt, a nested value.
    ('{"type": "cancel", "id": "a\\ud800"}', wire.INVALID_MESSAGE, "field 'id' is not valid Unicode"),
    ('{"type": "status", "\\udc00x": 1}', wire.INVALID_MESSAGE, "a field name in the frame"),
    ('{"type": "generate", "id": "x", "prompt": "hi \\ud83d"}', wire.INVALID_MESSAGE, "'prompt'"),
    ('{"type": "chat", "id": "x", "messages": [{"role": "user", "content": "\\udfff"}]}', wire.INVALID_MESSAGE,
     "'messages[0].content'"),
    ('{"type": "generate", "id": "x", "prompt": "a", "params": {"stop": ["\\ud800"]}}', wire.INVALID_MESSAGE,
     "U+D800"),
])
def test_bad_frames_name_the_problem(frame, code, words):
    err = error_of(frame)
    assert err.code == code
    assert words in err.message


@pytest.mark.parametrize("value", [-1, 21, 2**70, 1.0, "3", True, [2], {}])
def test_bad_prompt_logprobs_are_invalid_params_naming_the_field(value):
    err = error_of({"type": "generate", "id": "p", "prompt": "a", "params": {"prompt_logprobs": value}})
    assert (err.code, err.request_id) == ("invalid_params", "p")
    assert "prompt_logprobs" in err.message


@pytest.mark.parametrize("binary", [False, True])
def test_prompt_logprobs_parse_and_their_event_encodes(binary):
    for value in (None, 0, 20):
        gen = parse({"type": "generate", "id": "a", "prompt": "Hi", "params": {"prompt_logprobs": value}}, binary)
        assert gen.params.prompt_logprobs == value
    event = PromptLogprobs("engine-id", (TokenLogprob(7, -1.5, ((3, -0.25), (7, -1.5))),
                                         TokenLogprob(2, float("-inf"), ())))
    back = wire.decode_event(wire.encode(wire.event_to_wire(event, "mine"), binary))
    assert back == {"type": "prompt_logprobs", "id": "mine", "logprobs": [
        {"token_id": 7, "logprob": -1.5, "top": [[3, -0.25], [7, -1.5]]},
        {"token_id": 2, "logprob": float("-inf") if binary else None, "top": []}]}  # JSON has no -inf


def test_errors_after_the_id_carry_the_request_id():
    assert error_of('{"type": "generate", "id": "r7", "prompt": "a", "params": {"n": 0}}').request_id == "r7"
    assert error_of('{"type": "generate", "id": "r8", "prompt": "a", "extra": 1}').request_id == "r8"
    assert error_of('{"type": "nope", "id": "r9"}').request_id == "r9"


def test_oversize_frames_are_refused_before_decoding():
    big = json.dumps({"type": "generate", "id": "x", "prompt": "a" * MAX})
    err = error_of(big)
    assert err.code == wire.FRAME_TOO_LARGE and str(len(big)) in err.message
    assert error_of(b"\x00" * (MAX + 1)).code == wire.FRAME_TOO_LARGE


def test_deep_nesting_is_a_bad_frame_not_a_crash():
    assert error_of("[" * 30_000 + "]" * 30_000).code == wire.BAD_FRAME
    assert "16 deep" in error_of('{"a":' * 17 + "1" + "}" * 17).message
    assert "16 deep" in error_of(msgpack.packb(nested_lists(17))).message
    # Brackets inside strings are not nesting; 16 levels of real nesting are allowed.
    frame = {"type": "generate", "id": "x", "prompt": "[{" * 5000, "params": {"stop": ["]]", "{{"]}}
    assert wire.parse_frame(json.dumps(frame), MAX).prompt == "[{" * 5000
    err = error_of(json.dumps({"type": "status", "x": nested_lists(15)}))  # 16 levels with the frame
    assert err.code == wire.UNKNOWN_FIELD


def nested_lists(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_fatal_codes():
    assert wire.ProtocolError(wire.UNAUTHORIZED, "x").fatal
    assert not wire.ProtocolError(wire.BAD_FRAME, "x").fatal


USAGE = Usage(prompt_tokens=3, completion_tokens=2, ttft_s=0.1, tpot_s=0.02, peak_kv_bytes=4096)
EVENTS = [
    Accepted("engine-id", 2, 3),
    Token("engine-id", (5,), "Hi", 0.1),
    Token("engine-id", (6,), "!", 0.12, logprobs=(TokenLogprob(6, -0.5, ((6, -0.5), (7, float("-inf")))),)),
    Finished("engine-id", "length", USAGE, text="Hi!"),
    Error("engine-id", "overloaded", "queue full", retry_after_s=1.5),
]


@pytest.mark.parametrize("binary", [False, True])
def test_events_encode_with_the_client_id_and_round_trip(binary):
    wires = [wire.event_to_wire(e, "mine") for e in EVENTS]
    assert [w["type"] for w in wires] == ["accepted", "token", "token", "done", "error"]
    assert all(w["id"] == "mine" for w in wires)
    back = [wire.decode_event(wire.encode(w, binary)) for w in wires]
    assert isinstance(wire.encode(wires[0], binary), bytes if binary else str)
    assert back[0] == {"type": "accepted", "id": "mine", "queue_position": 2, "prompt_tokens": 3}
    assert back[1]["text"] == "Hi" and back[1]["token_ids"] == [5] and "logprobs" not in back[1]
    top = back[2]["logprobs"][0]["top"]
    assert top[0] == [6, -0.5]
    assert top[1][1] is None if not binary else top[1][1] == float("-inf")  # JSON has no -inf
    done = back[3]
    assert done["finish_reason"] == "length" and done["text"] == "Hi!"
    assert done["usage"]["completion_tokens"] == 2 and done["ttft_s"] == 0.1 and done["kv_bytes"] == 4096
    assert back[4] == {"type": "error", "id": "mine", "code": "overloaded", "message": "queue full",
                       "retry_after_s": 1.5}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(obj=st.dictionaries(st.sampled_from(["type", "id", "prompt", "params", "messages", "version", "token",
                                            "prompt_token_ids", "x"]), json_values, max_size=5),
       kind=st.sampled_from(["hello", "generate", "chat", "cancel", "status", None]),
       binary=st.booleans())
def test_any_object_parses_or_raises_protocol_error(obj, kind, binary):
    if kind is not None:
        obj["type"] = kind
    frame = msgpack.packb(obj) if binary else json.dumps(obj)
    try:
        msg = wire.parse_frame(frame, MAX)
    except wire.ProtocolError as exc:
        assert exc.code and exc.message
    else:
        assert type(msg).__name__.lower() == obj["type"]


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=200) | st.text(max_size=200))
def test_any_bytes_parse_or_raise_protocol_error(data):
    try:
        wire.parse_frame(data, MAX)
    except wire.ProtocolError as exc:
        assert exc.code in (wire.BAD_FRAME, wire.INVALID_MESSAGE, wire.UNKNOWN_TYPE, wire.UNKNOWN_FIELD,
                            wire.UNSUPPORTED_VERSION, "invalid_params")


def test_generate_and_chat_name_the_params_the_client_set() -> None:
    """So the engine can fill the rest from the model's generation_config.json."""
    frame = {"type": "generate", "id": "a", "prompt": "hi", "params": {"temperature": 0.5, "top_p": None}}
    assert wire.parse_frame(json.dumps(frame), 1 << 20).params_given == {"temperature"}
    chat = {"type": "chat", "id": "b", "messages": [{"role": "user", "content": "hi"}]}
    assert wire.parse_frame(json.dumps(chat), 1 << 20).params_given == frozenset()


@pytest.mark.parametrize("binary", [False, True])
def test_a_guide_parses_and_a_malformed_one_is_invalid_params(binary):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    gen = parse({"type": "generate", "id": "g", "prompt": "Hi", "params": {"guide": ["json_schema", schema]}}, binary)
    assert gen.params.guide == ("json_schema", schema)
    for bad, words in ((["yaml", "a: 1"], "kind"), (["json_schema", "{"], "not JSON"), ("regex", "pair")):
        err = error_of({"type": "generate", "id": "g", "prompt": "a", "params": {"guide": bad}})
        assert (err.code, err.request_id) == ("invalid_params", "g") and "guide" in err.message and words in err.message
