"""What a request's stream yields: frozen plain-data events, msgpack-encodable via to_dict().

The Engine's `generate()` yields exactly one Accepted (or an Error), then Token events, then
exactly one Finished or Error, and stops. A request with SamplingParams.prompt_logprobs also gets
one PromptLogprobs, before its first Token. The transport turns each into a wire frame. `Health` is
what the engine says of itself (the server's /healthz).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Stable error codes; clients switch on these.
PROMPT_TOO_LONG = "prompt_too_long"
INVALID_PARAMS = "invalid_params"
OVERLOADED = "overloaded"
CANCELLED = "cancelled"
INTERNAL = "internal_error"
ENGINE_CLOSED = "engine_closed"
SLOW_READER = "slow_reader"  # the request's events outpaced its reader; it was cancelled
ERROR_CODES = (PROMPT_TOO_LONG, INVALID_PARAMS, OVERLOADED, CANCELLED, INTERNAL, ENGINE_CLOSED, SLOW_READER)


@dataclass(frozen=True)
class Accepted:
    request_id: str
    queue_position: int  # 0: scheduled at once
    prompt_tokens: int
    type: str = "accepted"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) alternatives, best first


@dataclass(frozen=True)
class Token:
    request_id: str
    token_ids: tuple[int, ...]  # usually one; several after an accepted speculative draft
    text: str  # text delta, whole characters only, stop strings held back
    time_s: float  # seconds since the request arrived
    logprobs: tuple[TokenLogprob, ...] | None = None
    index: int = 0  # choice index when n > 1
    type: str = "token"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's tokens scored by the model (SamplingParams.prompt_logprobs): logprobs[i] is
    prompt token i + 1's, given the tokens before it (the first token has none), with the
    requested alternatives in `top`. Sent once per request, after the prompt's last step."""

    request_id: str
    logprobs: tuple[TokenLogprob, ...]
    type: str = "prompt_logprobs"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prefix-cache tokens reused
    queue_time_s: float = 0.0
    ttft_s: float = 0.0  # arrival -> first token
    tpot_s: float = 0.0  # mean time per output token after the first
    total_time_s: float = 0.0
    peak_kv_bytes: int = 0


@dataclass(frozen=True)
class Finished:
    request_id: str
    finish_reason: str  # "stop" | "length" | "eos" | "cancelled"
    usage: Usage
    text: str = ""  # the whole completion (choice 0)
    choices: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # n > 1 / beam results
    type: str = "done"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Error:
    request_id: str
    code: str  # one of ERROR_CODES
    message: str
    retry_after_s: float | None = None  # with OVERLOADED
    type: str = "error"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Event = Accepted | PromptLogprobs | Token | Finished | Error


class RequestError(Exception):
    """A request refused or failed, with a stable code (see ERROR_CODES)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Health:
    """The engine's state: "ok"; "restarting" after a failed model step (requests queue and run
    once it is back); "failed" after too many failures in a row (requests get internal_error);
    "closed" once shut down. `reason` names the last failure; `restarts` counts them."""

    status: str
    reason: str = ""
    restarts: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
