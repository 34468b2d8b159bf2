"""GenerateRequest: one completion request as every front end hands it to an engine. Plain data,
so the transport builds it without loading the model's code (the echo engine takes it too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeinfer.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """One completion request: exactly one of prompt, prompt_token_ids or messages (a chat,
    rendered with the model's chat template)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    # Chat messages as the template takes them; tool-calling turns carry nested values
    # (an assistant's `tool_calls`, a tool message's `tool_call_id`).
    messages: tuple[dict[str, Any], ...] | None = None
    # Function tools (OpenAI's shape) for the chat template's own `tools` variable.
    tools: tuple[dict[str, Any], ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    # The sampling fields the client set; the engine fills the others from the model's own
    # defaults (generation_config.json). None: all of them are the caller's (tools, tests).
    params_given: frozenset[str] | None = None
