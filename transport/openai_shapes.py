"""OpenAI's response shapes for transport.openai_api: the state of each choice as events stream in
(`Choice`, written only by the request's own handler), what a request answers with (`Reply`),
and the dicts of a whole choice, a streamed tool call, logprobs, usage and timings."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.core.events import TokenLogprob, Usage
from transport.tool_calls import ToolCall, ToolCallStream, parse_tool_calls
from transport.tool_scan import CallDelta


@dataclass
class Choice:
    """One choice's text and logprobs as they stream in, and how it ended."""

    text: list[str] = field(default_factory=list)
    chars: int = 0  # len("".join(text)), kept as it grows: summing it per token was quadratic
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: ToolCallStream | None = None  # a chat with tools: splits content from calls


@dataclass
class Reply:
    """What one API request is answering: its id, shape, model name and options."""

    chat: bool
    model: str
    n: int
    logprobs: bool
    include_usage: bool
    guide_param: str | None = None  # the parameter a guide came from (transport.openai_guide)
    tool_family: str | None = None  # the chat template's call syntax, when calls are parsed
    parallel_tool_calls: bool = True
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def _token_entry(token_id: int, logprob: float, tokenizer: Any) -> dict[str, Any]:
    raw = tokenizer.token_bytes([token_id], skip_special=False)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def logprobs_of(chat: bool, entries: Any, tokenizer: Any, offset: int) -> dict[str, Any]:
    """Chat's `content[]` shape, or the completions API's tokens / token_logprobs / top_logprobs /
    text_offset shape (offsets counted from `offset`, in characters of the completion)."""
    rows = [(_token_entry(e.token_id, e.logprob, tokenizer), [_token_entry(t, lp, tokenizer) for t, lp in e.top])
            for e in entries]
    if chat:
        return {"content": [{**row, "top_logprobs": top} for row, top in rows], "refusal": None}
    offsets = list(itertools.accumulate((len(row["token"]) for row, _ in rows), initial=offset))[:-1]
    return {"tokens": [row["token"] for row, _ in rows], "token_logprobs": [row["logprob"] for row, _ in rows],
            "top_logprobs": [{t["token"]: t["logprob"] for t in top} for _, top in rows], "text_offset": offsets}


def _max_calls(reply: Reply) -> int | None:
    return None if reply.parallel_tool_calls else 1


def new_choices(num: int, reply: Reply) -> list[Choice]:
    family = reply.tool_family
    return [Choice(tool_calls=ToolCallStream(family, _max_calls(reply)) if family else None) for _ in range(num)]


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def call_delta(delta: CallDelta) -> dict[str, Any]:
    """A streamed call's delta as OpenAI streams it: first index, id, type and name (arguments
    empty), then index and a fragment of the arguments."""
    if delta.id is None:
        return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.arguments}}]}
    return {"tool_calls": [{"index": delta.index, "id": delta.id, "type": "function",
                            "function": {"name": delta.name, "arguments": delta.arguments}}]}


def end_of_calls(choice: Choice) -> list[dict[str, Any]]:
    """The deltas a streamed choice with tools ends with (the content still held); a choice whose
    calls were well formed to their end ends as `tool_calls`, even when a length limit ended it."""
    if choice.tool_calls is None:
        return []
    rest = choice.tool_calls.finish()
    if choice.tool_calls.complete:
        choice.finish_reason = "tool_calls"
    return [{"content": rest}] if rest else []


def chat_choice(index: int, choice: Choice, tokenizer: Any, reply: Reply) -> dict[str, Any]:
    text, calls = "".join(choice.text), []
    if choice.tool_calls is not None:
        text, calls = parse_tool_calls(text, choice.tool_calls.family, _max_calls(reply))
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
    if calls:
        choice.finish_reason = "tool_calls"  # calls that parse were complete, even when a length limit ended the answer
        message["tool_calls"] = [_call_dict(c) for c in calls]
    return {"index": index, "message": message,
            "logprobs": logprobs_of(True, choice.logprobs, tokenizer, 0) if tokenizer else None,
            "finish_reason": choice.finish_reason}


def completion_choice(index: int, choice: Choice, tokenizer: Any) -> dict[str, Any]:
    return {"index": index, "text": "".join(choice.text),
            "logprobs": logprobs_of(False, choice.logprobs, tokenizer, 0) if tokenizer else None,
            "finish_reason": choice.finish_reason}


def usage_of(usages: list[Usage]) -> dict[str, Any]:
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in usages)}}


def timings_of(usages: list[Usage]) -> dict[str, Any]:
    """The extra field (as llama.cpp's server adds one): the slowest prompt's latencies, in seconds."""
    if not usages:
        return {}
    last = max(usages, key=lambda u: u.total_time_s)
    return {"queue_time_s": last.queue_time_s, "ttft_s": last.ttft_s, "tpot_s": last.tpot_s,
            "total_time_s": last.total_time_s, "cached_prompt_tokens": sum(u.cached_prompt_tokens for u in usages)}
