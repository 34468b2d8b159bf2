"""The OpenAI HTTP API's request models (pydantic), their mapping onto SamplingParams, and the
error body every refusal is answered with.

Requests are validated in two passes: pydantic for shapes and types (its error location becomes
the `param` named in the 400), then SamplingParams for ranges (its InvalidParams names its own
field, translated here to the OpenAI parameter the client sent). Unknown fields are ignored, as
OpenAI's server does; fields OpenAI defines that this engine cannot honour yet are refused by
name (`REFUSED_*`), never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgeinfer.core.sampling_params import InvalidParams, SamplingParams

# OpenAI fields the engine cannot honour (yet): a request that sets one gets a 400 naming it.
REFUSED_COMMON = ("functions", "function_call", "audio",
                  "modalities", "prediction", "web_search_options", "suffix", "best_of")
REFUSED_TRUE = ("echo",)  # refused only when true: false is what we do anyway


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: status, message, type, param, code (+ Retry-After)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    """A 400 whose message names the parameter too (clients often show only the message)."""
    if param and param not in message:
        message = f"{param}: {message}"
    return OpenAIError(400, message, "invalid_request_error", param, code)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept so refused fields can be named; others ignored


class StreamOptions(_Lenient):
    include_usage: bool = False


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str


class MessageToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, earlier in the chat
    tool_call_id: str | None = None  # a tool message answers this call


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class _Generation(_Lenient):
    model: str
    max_tokens: int | None = None
    # OpenAI's own ranges, stricter than the engine's: a value outside them is a 400, as at OpenAI.
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions, named as vLLM and llama.cpp's server name them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    # Structured output (transport.openai_guide): OpenAI's response_format, or one of vLLM's.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: Any) -> Any:
    """The request model from a JSON body, or a 400 naming the first bad parameter."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param_name(first["loc"])
        raise invalid(param, first["msg"]) from None
    extra = request.model_extra or {}
    for name in REFUSED_COMMON:
        if extra.get(name) is not None:
            raise invalid(name, f"{name} is not supported by this server yet")
    for name in REFUSED_TRUE:
        if extra.get(name):
            raise invalid(name, f"{name}=true is not supported by this server")
    return request


def _param_name(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location as OpenAI names parameters: messages[0].content."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not name:
            name = str(part)
        elif part in ("str", "list[ContentPart]", "list[str]", "list[int]", "list[list[int]]", "int"):
            break  # pydantic names the union member it tried: not part of the parameter
        else:
            name += f".{part}"
    return name or None


def chat_messages(request: ChatRequest) -> tuple[dict[str, Any], ...]:
    """Messages as chat templates take them (transformers' shape): roles system/user/assistant/tool,
    text content, an assistant's `tool_calls` and a tool message's `tool_call_id` (keys present only
    when set: templates test `'tool_calls' in message`)."""
    messages = []
    for i, message in enumerate(request.messages):
        role = "system" if message.role == "developer" else message.role
        if role not in ("system", "user", "assistant", "tool"):
            raise invalid(f"messages[{i}].role", f"role {message.role!r} is not supported "
                          "(system, developer, user, assistant, tool)")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise invalid(f"messages[{i}].content[{j}].type",
                                  f"content parts of type {part.type!r} are not supported (text only)")
                texts.append(part.text)
            content = "".join(texts)
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.tool_calls and role == "assistant":
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                   for c in message.tool_calls]
        if role == "tool":
            if message.tool_call_id is None:
                raise invalid(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
            entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
        messages.append(entry)
    return tuple(messages)


def tool_choice(request: ChatRequest) -> tuple[str, str | None]:
    """("none" | "auto" | "required", the function a named choice forces); OpenAI's default is
    "auto" with tools and "none" without."""
    choice = request.tool_choice
    names = [t.function.name for t in request.tools or ()]
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice == "required" and not names:
            raise invalid("tool_choice", "tool_choice 'required' needs tools")
        return choice, None
    if choice.function.name not in names:
        raise invalid("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools")
    return "required", choice.function.name


def completion_prompts(request: CompletionRequest) -> list[str | tuple[int, ...]]:
    """One entry per prompt: a string, or token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [tuple(prompt)]  # type: ignore[arg-type]
    return [p if isinstance(p, str) else tuple(p) for p in prompt]  # type: ignore[misc]


def sampling_params(request: ChatRequest | CompletionRequest, guide: tuple[str, str] | None = None,
                    guide_param: str | None = None) -> SamplingParams:
    """The request's SamplingParams, with `guide` (transport.openai_guide: from the parameter
    guide_param); out-of-range values get a 400 naming the OpenAI parameter."""
    names = {"max_tokens": "max_tokens", "logprobs": "logprobs", "guide": guide_param or "guide"}
    max_tokens = request.max_tokens
    if isinstance(request, ChatRequest):
        if request.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = request.max_completion_tokens, "max_completion_tokens"
        if request.top_logprobs is not None and not request.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs=true")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        names["logprobs"] = "top_logprobs"
    else:
        logprobs = request.logprobs
    try:
        bias = {int(k): v for k, v in (request.logit_bias or {}).items()}
    except ValueError:
        raise invalid("logit_bias", "logit_bias keys must be token ids") from None
    given: dict[str, Any] = {
        "max_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "presence_penalty": request.presence_penalty, "frequency_penalty": request.frequency_penalty,
        "top_k": request.top_k, "min_p": request.min_p, "repetition_penalty": request.repetition_penalty,
        "min_tokens": request.min_tokens, "seed": request.seed}
    try:
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None}, n=request.n, logprobs=logprobs,
            stop=request.stop or (), logit_bias=bias, ignore_eos=request.ignore_eos, guide=guide)
    except InvalidParams as exc:
        field = str(exc).split(" ", 1)[0]
        param = names.get(field, field)
        raise invalid(param, f"{param}{str(exc)[len(field):]}") from None


def given_fields(request: ChatRequest | CompletionRequest) -> frozenset[str]:
    """The SamplingParams fields the client set (not null): the engine fills the others with the
    model's generation defaults, then edgeinfer's (core.sampling_params.GENERATION_DEFAULTS)."""
    typed = {k for k in request.model_fields_set if getattr(request, k) is not None}
    return frozenset(typed | ({"max_tokens"} if "max_completion_tokens" in typed else set()))
