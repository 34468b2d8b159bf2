"""GenerateRequest: one completion request as every front end hands it to an engine. Plain data,
so the transport builds it without loading the model's code (the echo engine takes it too)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgeinfer.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    """One completion request: exactly one of prompt, prompt_token_ids or messages (a chat,
    rendered with the model's chat template)."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    # The sampling fields the client set; the engine fills the others from the model's own
    # defaults (generation_config.json). None: all of them are the caller's (tools, tests).
    params_given: frozenset[str] | None = None
