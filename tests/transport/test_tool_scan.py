"""Random tool calls (transport.tool_scan through ToolCallStream): JSON arguments with every
character a scanner could trip on, written compact, spaced or indented, as a JSON string (Llama 3),
before or after the name, framed per family and streamed in random pieces, whole, cut short and
with random edits. Seeded: a failure names the text to reproduce it with."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from transport.tool_calls import ToolCallStream, parse_tool_calls

ALPHABET = 'ab "\\{}[]:,;<>/\n\té😀\u2028\x01'
FAMILIES = ("hermes", "llama3", "mistral", "generic")


def text_of(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))


def value_of(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randint(0, 6 if depth < 3 else 3)
    if kind == 0:
        return rng.randint(-10**6, 10**6)
    if kind == 1:
        return rng.choice([True, False, None, 1.5e-7, -0.0])
    if kind in (2, 3):
        return text_of(rng)
    if kind == 4:
        return [value_of(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {text_of(rng): value_of(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def arguments_of(rng: random.Random) -> str:
    obj = {text_of(rng): value_of(rng) for _ in range(rng.randint(0, 4))}
    return rng.choice([json.dumps(obj), json.dumps(obj, ensure_ascii=False, separators=(",", ":")),
                       json.dumps(obj, indent=1, ensure_ascii=False), json.dumps(obj, indent="\t")])


def answer_of(rng: random.Random, family: str, calls: list[tuple[str, str, bool]]) -> str:
    key = "parameters" if family == "llama3" else "arguments"
    objects = []
    for name, arguments, as_string in calls:
        fields = [f'"name": {json.dumps(name)}', f'"{key}": {json.dumps(arguments) if as_string else arguments}']
        objects.append("{" + ", ".join(fields[::rng.choice([1, -1])]) + "}")
    if family == "hermes":
        return rng.choice(["", "Hi.\n"]) + "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
    if family == "llama3":
        return rng.choice(["", "<|python_tag|>"]) + "; ".join(objects)
    if family == "mistral":
        return rng.choice(["", "[TOOL_CALLS] "]) + "[" + ", ".join(objects) + "]"
    return '{"tool_calls": [' + ", ".join(objects) + "]}"


def stream(family: str, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]], bool]:
    """(content, [(name, arguments)], complete) as a client puts them together from the deltas."""
    calls: dict[int, list[str]] = {}
    content, at = [], 0
    chunked = ToolCallStream(family)
    while at < len(text):
        size = rng.choice([1, 1, 2, 3, 5, 8])
        piece_content, deltas = chunked.push(text[at:at + size])
        at += size
        content.append(piece_content)
        for delta in deltas:
            if delta.id is not None:
                calls[delta.index] = [delta.name or "", ""]
            else:
                calls[delta.index][1] += delta.arguments
    content.append(chunked.finish())
    return "".join(content), [(name, arguments) for name, arguments in calls.values()], chunked.complete


def random_calls(rng: random.Random, family: str, most: int) -> list[tuple[str, str, bool]]:
    return [(text_of(rng) or "f", arguments_of(rng), family == "llama3" and rng.random() < 0.4)
            for _ in range(rng.randint(1, most))]


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_stream_as_they_parse_whole(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        family = rng.choice(FAMILIES)
        calls = random_calls(rng, family, 3)
        text = answer_of(rng, family, calls)
        expected = [(name, arguments) for name, arguments, _ in calls]
        assert [(c.name, c.arguments) for c in parse_tool_calls(text, family)[1]] == expected, (family, text)
        _, streamed, complete = stream(family, text, rng)
        assert streamed == expected and complete, (family, text)
        cut = text[:rng.randint(0, len(text))]  # cut short: what was sent is a start of the truth
        _, streamed, _ = stream(family, cut, rng)
        assert all(expected[i][0] == name and expected[i][1].startswith(arguments)
                   for i, (name, arguments) in enumerate(streamed)), (family, cut)


@pytest.mark.parametrize("seed", range(4))
def test_edited_calls_never_raise_and_stream_as_they_parse_whole(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        family = rng.choice(FAMILIES)
        chars = list(answer_of(rng, family, random_calls(rng, family, 2)))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(chars))
            edit = rng.randint(0, 2)
            if edit == 0:
                del chars[at]
            elif edit == 1:
                chars.insert(at, rng.choice(ALPHABET))
            else:
                chars[at] = rng.choice(ALPHABET)
        text = "".join(chars)
        content, whole = parse_tool_calls(text, family)
        streamed_content, streamed, complete = stream(family, text, rng)
        if whole:  # a valid answer after all
            assert (streamed_content, streamed, complete) == (content, [(c.name, c.arguments) for c in whole], True)
        elif not streamed:  # never a call: all content, streamed as whole
            assert streamed_content == content == text, (family, text)
