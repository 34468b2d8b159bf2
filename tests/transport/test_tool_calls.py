"""Tool calls per template family: the prompt edgeinfer renders equals transformers'
`apply_chat_template(tools=...)` on the real templates (tests/chat_templates.py), and the calls a
template itself writes for an assistant turn parse back to the same names and arguments, whole
and streamed in random pieces."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from chat_templates import CHATML, FAMILY_TEMPLATES, LLAMA31, LLAMA32, MISTRAL_V03, QWEN25
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from edgeinfer.models.tokenizer import Tokenizer
from transport.tool_calls import ToolCallStream, parse_tool_calls, prepare_chat, template_family

SPECIALS = {QWEN25: (None, "<|im_end|>"), LLAMA31: ("<|begin_of_text|>", "<|eot_id|>"),
            LLAMA32: ("<|begin_of_text|>", "<|eot_id|>"), MISTRAL_V03: ("<s>", "</s>"),
            CHATML: (None, "<|im_end|>")}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city, in °C",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. Zürich or 東京"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def conversations(template: str) -> list[list[dict[str, Any]]]:
    multi = template is not LLAMA31 and template is not LLAMA32  # Llama 3 takes one call per turn
    calls = [_call("Ab3dE6gh9", "get_weather", {"city": "Zürich", "unit": "c"})]
    if multi:
        calls.append(_call("Zz9yY8xX7", "add", {"a": 17, "b": -4}))
    results = [{"role": "tool", "tool_call_id": "Ab3dE6gh9", "content": '{"temp": 21.5}'}]
    if multi:
        results.append({"role": "tool", "tool_call_id": "Zz9yY8xX7", "content": "13"})
    return [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}],
        [{"role": "user", "content": "Weather in Zürich, and 17 + -4?"},
         {"role": "assistant", "content": "", "tool_calls": calls}, *results,
         {"role": "assistant", "content": "21.5 °C; 13."}, {"role": "user", "content": "Thanks! And 東京?"}],
    ]


def tokenizers_for(template: str) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    bos, eos = SPECIALS[template]
    vocab = {t: i for i, t in enumerate(t for t in ("[UNK]", bos, eos) if t)}
    backend = HFTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    ours = Tokenizer(backend, bos_token_id=vocab.get(bos) if bos else None, eos_token_id=vocab[eos],
                     add_bos=False, chat_template=template)
    theirs = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token="[UNK]",
                                     chat_template=template)
    return ours, theirs


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_rendered_prompt_equals_transformers_and_family_is_detected(family: str) -> None:
    for template in FAMILY_TEMPLATES[family]:
        assert template_family(template) == family
        ours, theirs = tokenizers_for(template)
        for chat in conversations(template):
            messages, tools = prepare_chat(chat, TOOLS, family)
            assert (tools is None) == (family == "generic")
            mine = ours.apply_chat_template(messages, tools=tools)
            expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert mine == expected
            assert "get_weather" in mine and "Zürich" in mine  # the tools reached the prompt, unescaped
            if any(m.get("tool_calls") for m in chat):
                assert "17" in mine and "13" in mine  # the earlier calls and their results too


def assistant_turn(template: str, family: str, calls: list[dict[str, Any]]) -> str:
    """What the template itself writes for an assistant turn with these calls (the model's
    syntax), without the end-of-turn token the engine stops on."""
    ours, _ = tokenizers_for(template)
    user = [{"role": "user", "content": "Weather in Zürich, and 17 + -4?"}]
    messages, tools = prepare_chat([*user, {"role": "assistant", "content": "", "tool_calls": calls}], TOOLS, family)
    if family == "generic":
        return messages[-1]["content"]
    prompt_messages, _ = prepare_chat(user, TOOLS, family)
    prompt = ours.apply_chat_template(prompt_messages, tools=tools, add_generation_prompt=family != "mistral")
    full = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
    assert full.startswith(prompt)
    turn = full[len(prompt):]
    for end in ("<|im_end|>\n", "<|eot_id|>", "</s>"):
        turn = turn.removesuffix(end)
    return turn


def streamed(family: str, pieces: list[str], max_calls: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) as a client puts them together from the deltas of these pieces, checking
    OpenAI's order: a call's first delta has its index (the next one), id, name and empty
    arguments; its later deltas only arguments fragments, kept as a list."""
    stream, content, calls = ToolCallStream(family, max_calls), [], []
    for piece in pieces:
        text, deltas = stream.push(piece)
        assert not (text and calls), "content after a call started"
        content.append(text)
        for delta in deltas:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.name and delta.arguments == ""
                calls.append({"id": delta.id, "name": delta.name, "fragments": []})
            else:
                assert delta.index == len(calls) - 1 and delta.name is None and delta.arguments
                calls[-1]["fragments"].append(delta.arguments)
    content.append(stream.finish())
    assert [(c["id"], c["name"], "".join(c["fragments"])) for c in calls] == [
        (c.id, c.name, c.arguments) for c in stream.calls]
    return "".join(content), calls


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_calls_the_template_writes_parse_back_whole_and_streamed(family: str) -> None:
    rng = random.Random(7)
    template = FAMILY_TEMPLATES[family][0]
    weather, add = {"city": "Zürich", "unit": "c"}, {"a": 17, "b": -4}
    call_sets = [[_call("Ab3dE6gh9", "get_weather", weather)]]
    if family != "llama3":
        call_sets.append([_call("Ab3dE6gh9", "get_weather", weather), _call("Zz9yY8xX7", "add", add)])
    for calls in call_sets:
        text = assistant_turn(template, family, calls)
        expected = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        whole_content, whole = parse_tool_calls(text, family)
        assert [(c.name, json.loads(c.arguments)) for c in whole] == expected and not whole_content.strip()
        assert len({c.id for c in whole}) == len(whole)
        if family == "mistral":
            assert all(len(c.id) == 9 and c.id.isalnum() for c in whole)
        for _ in range(20):
            content, parsed = streamed(family, random_pieces(text, rng))
            assert content.strip() == ""
            assert [(c["name"], "".join(c["fragments"])) for c in parsed] == [(c.name, c.arguments) for c in whole]


# Arguments with what could be taken for the end of a call inside strings: escaped quotes,
# braces, brackets, a backslash before a brace, a surrogate pair written as escapes.
LONG_ARGS = (r'{"path": "C:\\tmp\\{a}", "say": "he said \"}]\" and left", "nested": {"list": [1, 2.5e3, '
             r'{"x": null}], "t": true}, "emoji": "\ud83d\ude00 é", "n": -17}')
SHORT_ARGS = '{"q": "</tool_call>; ]", "k": 2, "e": "😀"}'
STREAMED_ANSWERS = {  # (answer, content): every answer calls lookup(LONG_ARGS) then add(SHORT_ARGS)
    "hermes": [(f'Sure, checking.\n<tool_call>\n{{"name": "lookup", "arguments": {LONG_ARGS}}}\n</tool_call>\n'
                f'<tool_call>\n{{"name": "add", "arguments": {SHORT_ARGS}}}\n</tool_call>', "Sure, checking.\n")],
    "llama3": [(f'<|python_tag|>{{"name": "lookup", "parameters": {LONG_ARGS}}}; '
                f'{{"name": "add", "parameters": {SHORT_ARGS}}}', ""),
               (f'{{"name": "lookup", "parameters": {json.dumps(LONG_ARGS)}}};{{"name": "add", "parameters": '
                f'{json.dumps(SHORT_ARGS)}}}', "")],  # arguments as a JSON string: its decoded text streams
    "mistral": [(f'[TOOL_CALLS] [{{"name": "lookup", "arguments": {LONG_ARGS}}}, '
                 f'{{"arguments": {SHORT_ARGS}, "name": "add"}}]', "")],  # arguments before the name
    "generic": [(f'{{"tool_calls": [{{"name": "lookup", "arguments": {LONG_ARGS}}}, '
                 f'{{"name": "add", "arguments": {SHORT_ARGS}}}]}}', "")],
}


def token_pieces(text: str) -> list[str]:
    """Pieces the size of BPE tokens: a word, up to three digits or two symbols, with its space."""
    pieces = re.findall(r"\s?[A-Za-z]+|\s?\d{1,3}|\s?[^\sA-Za-z\d]{1,2}|\s+", text)
    assert "".join(pieces) == text
    return pieces


def awkward_pieces(text: str) -> list[str]:
    """Cuts inside the start tag, an escaped quote, a \\u escape, between the halves of a
    surrogate pair, in a number and before every closing brace or bracket."""
    cuts = {text.find(s) + k for s, k in [("<tool_call>", 4), ('\\"', 1), ("\\ud83d", 1), ("\\ud83d", 4),
                                          ("\\ude00", 0), ("2.5e3", 2)] if s in text}
    cuts |= {i for i, c in enumerate(text) if c in "}]"}
    cuts = sorted(c for c in cuts if 0 < c < len(text))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("family", list(STREAMED_ANSWERS))
def test_arguments_stream_in_fragments_that_add_up_to_the_whole_parse(family: str) -> None:
    assert json.loads(LONG_ARGS)["say"] == 'he said "}]" and left'
    rng = random.Random(3)
    for answer, content in STREAMED_ANSWERS[family]:
        whole_content, whole = parse_tool_calls(answer, family)
        assert (whole_content, [(c.name, c.arguments) for c in whole]) == (
            content, [("lookup", LONG_ARGS), ("add", SHORT_ARGS)])
        chunkings = [token_pieces(answer), list(answer), awkward_pieces(answer),
                     *(random_pieces(answer, rng) for _ in range(10))]
        for pieces in chunkings:
            streamed_content, calls = streamed(family, pieces)
            assert streamed_content == content
            assert [(c["name"], "".join(c["fragments"])) for c in calls] == [("lookup", LONG_ARGS), ("add", SHORT_ARGS)]
            if len(pieces) > 20:  # as the model writes them, not once the call has ended
                assert len(calls[0]["fragments"]) > 10
        # parallel_tool_calls false: the first call only, streamed or whole
        assert [c["name"] for c in streamed(family, token_pieces(answer), max_calls=1)[1]] == ["lookup"]
        assert [c.name for c in parse_tool_calls(answer, family, max_calls=1)[1]] == ["lookup"]


def test_a_call_cut_short_streams_what_came_but_parses_whole_as_content() -> None:
    answer = STREAMED_ANSWERS["generic"][0][0]
    cut = answer[:answer.index("nested")]
    stream = ToolCallStream("generic")
    sent = [d for piece in token_pieces(cut) for d in stream.push(piece)[1]]
    assert stream.finish() == "" and not stream.complete
    arguments = "".join(d.arguments for d in sent)
    assert sent[0].name == "lookup" and LONG_ARGS.startswith(arguments) and len(arguments) > 40
    assert parse_tool_calls(cut, "generic") == (cut, [])


def test_text_that_stops_being_a_call_is_released_as_content() -> None:
    answer = 'Hi <tool_call>\n{"name": "x", "arguments": 5}</tool_call> and <tool_call> more'
    content, calls = streamed("hermes", token_pieces(answer))
    assert (content, calls) == (answer, [])
    stream = ToolCallStream("generic")
    assert stream.push(' {"a": ') == ("", []) and stream.push("1 ") == ("", [])
    assert stream.push("2} ok") == (' {"a": 1 2} ok', [])  # no JSON: released at once
    assert stream.push(" then") == (" then", [])


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_plain_answers_stay_content_streamed_as_they_come(family: str) -> None:
    answers = ["Paris is the capital of France.", "{curly} but no call", "[1] a citation", "  <tool_ not a call",
               "I will call <tool_call>{\"name\": 5}</tool_call>", '{"name": "x", "arguments": [1]}',
               "emoji 😀 <tool_call", ""]
    for answer in answers:
        content, calls = parse_tool_calls(answer, family)
        assert (content, calls) == (answer, [])
    stream = ToolCallStream(family)
    assert stream.push("Paris") == ("Paris", [])  # content that cannot start a call is not held
    assert stream.push(" is") == (" is", [])


def test_hermes_content_before_a_call_streams_first() -> None:
    stream = ToolCallStream("hermes")
    pieces = [stream.push(p) for p in ["Let me check.", "\n<tool", "_call>\n{\"name\": \"add\", ",
                                       "\"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"]]
    assert [content for content, _ in pieces] == ["Let me check.", "\n", "", ""]
    assert pieces[2][1] == []  # the name alone is not yet a call: its arguments might be no object
    assert [(d.name, d.arguments) for d in pieces[3][1]] == [("add", ""), (None, '{"a": 1, "b": 2}')]
    assert stream.finish() == "" and stream.complete


def test_generic_takes_a_bare_call_too() -> None:
    content, calls = parse_tool_calls(' {"name": "add", "arguments": {"a": 1, "b": 2}}', "generic")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


def test_generic_chat_describes_tools_and_writes_history() -> None:
    messages, tools = prepare_chat(conversations(MISTRAL_V03)[1], TOOLS, "generic")
    assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert {m["role"] for m in messages} == {"system", "user", "assistant"}
    assert parse_tool_calls(messages[2]["content"], "generic")[1][1].name == "add"


def byte_tokenizer(*specials: str) -> tuple[HFTokenizer, int]:
    """A byte-level BPE without merges (every byte its own token) plus an end token and these
    special tokens: any text tokenizes, so a guide can be walked over exactly the text a template
    writes."""
    from tokenizers import decoders, pre_tokenizers
    from tokenizers.models import BPE

    from edgeinfer.models.tokenizer import _bytes_to_unicode

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    backend = HFTokenizer(BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>", *specials])
    return backend, backend.token_to_id("<|end|>")


def ours(backend: HFTokenizer, end: int) -> Tokenizer:
    return Tokenizer(backend, bos_token_id=None, eos_token_id=end, add_bos=False, chat_template=None)


def allowed(mask: bytes, token_id: int) -> bool:
    return bool(int.from_bytes(mask[4 * (token_id // 32):4 * (token_id // 32) + 4], "little") >> (token_id % 32) & 1)


def mistral_turn(calls: list[dict[str, Any]]) -> str:
    """The Mistral template's call syntax less the ids (which the guide leaves to the server)."""
    text = assistant_turn(MISTRAL_V03, "mistral", calls)
    without_ids = json.dumps([{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                              for c in calls], ensure_ascii=False)
    assert text.startswith("[TOOL_CALLS] [{") and json.loads(text.removeprefix("[TOOL_CALLS]")) == [
        {**c, "id": call["id"]} for c, call in zip(json.loads(without_ids), calls, strict=True)]
    return "[TOOL_CALLS] " + without_ids


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_required_guide_accepts_the_family_syntax_and_the_parser_reads_it(family: str) -> None:
    from edgeinfer.core.guides import GuideCompiler
    from transport.tool_guides import tool_call_guide

    # Mistral's [TOOL_CALLS]: a special token where the tokenizer has one, else plain text.
    for backend, end in [byte_tokenizer(), *([byte_tokenizer("[TOOL_CALLS]")] if family == "mistral" else [])]:
        tokenizer = ours(backend, end)
        compiler = GuideCompiler(backend.to_str, backend.get_vocab_size(), [end])
        weather = _call("Ab3dE6gh9", "get_weather", {"city": "Zürich", "unit": "c"})
        add = _call("Zz9yY8xX7", "add", {"a": 17, "b": -4})
        for calls, name, parallel in [([weather], None, True), ([weather], "get_weather", False),
                                      ([weather, add], None, True), ([add], "add", True)]:
            if family == "llama3" and len(calls) > 1:
                continue
            text = mistral_turn(calls) if family == "mistral" else assistant_turn(FAMILY_TEMPLATES[family][0],
                                                                                   family, calls)
            guide = compiler.guide(*tool_call_guide(family, TOOLS, tokenizer, name, parallel))
            token_ids = backend.encode(text).ids
            for token_id in token_ids:
                assert allowed(guide.mask(), token_id), (family, text)
                guide.advance(token_id)
            assert guide.is_complete or allowed(guide.mask(), end)
            decoded = tokenizer.decode(token_ids)  # as the engine streams it: special tokens dropped
            assert [c.name for c in parse_tool_calls(decoded, family)[1]] == [c["function"]["name"] for c in calls]
    # A call of another tool than the one named, or a second call when not parallel, is refused.
    wrong = json.dumps({"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]})
    guide = compiler.guide(*tool_call_guide("generic", TOOLS, tokenizer, "get_weather"))
    assert guide.num_valid(backend.encode(wrong).ids) < len(backend.encode(wrong).ids)


def test_mistral_guide_writes_the_call_token_the_tokenizer_has() -> None:
    from edgeinfer.core.guides import GuideCompiler
    from transport.tool_guides import tool_call_guide

    bare = json.dumps([{"name": "add", "arguments": {"a": 1, "b": 2}}])
    for specials in [(), ("[TOOL_CALLS]",)]:
        backend, end = byte_tokenizer(*specials)
        tokenizer = ours(backend, end)
        guide = GuideCompiler(backend.to_str, backend.get_vocab_size(), [end]).guide(
            *tool_call_guide("mistral", TOOLS, tokenizer))
        bare_ids = backend.encode(bare).ids  # never the bare array ("[" is the plain text's first byte too)
        assert guide.num_valid(bare_ids) == (0 if specials else 1)
        first = backend.encode("[TOOL_CALLS]").ids
        assert len(first) == (1 if specials else len("[TOOL_CALLS]"))
        assert [allowed(guide.mask(), t) for t in range(backend.get_vocab_size())].count(True) == 1
        assert allowed(guide.mask(), first[0])  # the special token, or the text's first byte
