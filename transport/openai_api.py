"""The OpenAI-compatible HTTP API on the server's port: /v1/models, /v1/chat/completions,
/v1/completions, /tokenize and /detokenize (transport.openai_schema holds the request models).

Each completion request becomes one engine request per prompt (n choices each), answered in
OpenAI's shapes, whole or as server-sent events. The engine's first event (accepted or an error)
is awaited before answering, so refusals (overloaded, prompt too long) get their HTTP status even
when streaming. Closing a request's event stream is its cancellation, as on the websocket: a
client that disconnects mid-stream closes the SSE generator (Starlette watches for the
disconnect), which closes every engine stream it holds, freeing their KV blocks. `OpenAIApi`
alone writes its in-flight count, which the server's drain waits on. A chat with tools renders
them for the model's template family and splits each choice into content and `tool_calls`
(transport.tool_calls); `tool_choice` "required" or a named function adds the guide that forces
a call (transport.tool_guides). Access: the server's token or an --api-key as Bearer, the
browser Origin rule of the websocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgeinfer.core.events import (
    ENGINE_CLOSED,
    INTERNAL,
    INVALID_PARAMS,
    OVERLOADED,
    PROMPT_TOO_LONG,
    Error,
    Event,
    Finished,
    RequestError,
    Token,
    Usage,
)
from edgeinfer.core.request import GenerateRequest
from transport import auth
from transport.openai_guide import guide_of
from transport.openai_schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    chat_messages,
    completion_prompts,
    given_fields,
    invalid,
    parse,
    sampling_params,
    tool_choice,
)
from transport.openai_shapes import (
    Choice,
    Reply,
    call_delta,
    chat_choice,
    completion_choice,
    end_of_calls,
    logprobs_of,
    new_choices,
    timings_of,
    usage_of,
)
from transport.tool_calls import prepare_chat, template_family
from transport.tool_guides import tool_call_guide

_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class OpenAIApi:
    """The OpenAI routes of one Server (transport.server), which it reads: engine, config, counters."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.in_flight = 0
        self._ids = itertools.count(1)

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self._guard(self._models), methods=["GET"]),
                Route("/v1/chat/completions", self._guard(self._chat), methods=["POST"]),
                Route("/v1/completions", self._guard(self._completions), methods=["POST"]),
                Route("/tokenize", self._guard(self._tokenize), methods=["POST"]),
                Route("/detokenize", self._guard(self._detokenize), methods=["POST"])]

    def _guard(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Auth, browser origin and health before the handler; every OpenAIError as its JSON body."""
        async def guarded(request: Request) -> Response:
            try:
                self._check_access(request)
                return await handler(request)
            except OpenAIError as exc:
                self.server.counters[f"error:{exc.code or exc.type}"] += 1
                headers = {} if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
                return JSONResponse(exc.body(), exc.status, headers=headers)
        return guarded

    def _check_access(self, request: Request) -> None:
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else None
        config = self.server.config
        if not any(auth.token_matches(token, key) for key in (config.token, *config.api_keys)):
            self.server.counters["refused_token"] += 1
            raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the "
                              "server's --api-key or its token",
                              "invalid_request_error", None, "invalid_api_key")
        if not auth.origin_allowed(request.headers.get("origin"), request.headers.get("host"),
                                   self.server.allowed_hosts, self.server.config.allowed_origins):
            self.server.counters["refused_origin"] += 1
            raise OpenAIError(403, "Origin is not allowed", "invalid_request_error", None, "forbidden_origin")
        health = self.server.engine.health()
        if self.server.draining or not health.ok:
            reason = "the server is shutting down" if self.server.draining else f"{health.status}: {health.reason}"
            raise OpenAIError(503, reason, "server_error", None, "service_unavailable", retry_after_s=1.0)

    async def _json(self, request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except ValueError:
            raise invalid(None, "the body is not valid JSON") from None

    def _check_model(self, model: str | None) -> None:
        name = self.server.model_name
        if model is not None and model not in (name, name.removesuffix(".gguf")):
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                              "invalid_request_error", "model", "model_not_found")

    # ---- routes ---------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "edgeinfer"}]})

    async def _tokenize(self, request: Request) -> Response:
        body = parse(TokenizeRequest, await self._json(request))
        self._check_model(body.model)
        tokenizer = self.server.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt", "give exactly one of prompt or messages")
        if body.prompt is not None:
            tokens = tokenizer.encode(body.prompt, add_special=body.add_special_tokens)
        else:
            chat = ChatRequest(model="", messages=body.messages)
            messages, _ = prepare_chat(list(chat_messages(chat)), None, template_family(tokenizer.chat_template))
            text = tokenizer.apply_chat_template(messages)
            tokens = tokenizer.encode(text, add_special=False)  # the template has them
        return JSONResponse({"tokens": tokens, "count": len(tokens)})

    async def _detokenize(self, request: Request) -> Response:
        body = parse(DetokenizeRequest, await self._json(request))
        self._check_model(body.model)
        tokenizer = self.server.engine.tokenizer
        if any(not 0 <= t < tokenizer.vocab_size for t in body.tokens):
            raise invalid("tokens", f"tokens must be ids in [0, {tokenizer.vocab_size})")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special=False)})

    async def _chat(self, request: Request) -> Response:
        body = parse(ChatRequest, await self._json(request))
        self._check_model(body.model)
        guide, guide_param = guide_of(body)
        choice, forced = tool_choice(body)
        family = template_family(self.server.engine.tokenizer.chat_template)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] if choice != "none" else None
        messages, template_tools = prepare_chat(list(chat_messages(body)), tools, family)
        if choice == "required" and tools:  # constrained decoding writes a call in the family's syntax
            if guide is not None:
                raise invalid("tool_choice", f"tool_choice {body.tool_choice!r} forces a tool call; it cannot be "
                              f"combined with {guide_param}")
            guide = tool_call_guide(family, tools, self.server.engine.tokenizer, forced,
                                    body.parallel_tool_calls is not False)
            guide_param = "tool_choice"
        params = sampling_params(body, guide, guide_param)
        reply = Reply(True, self.server.model_name, body.n, body.logprobs,
                       bool(body.stream_options and body.stream_options.include_usage), guide_param,
                       tool_family=family if tools else None, parallel_tool_calls=body.parallel_tool_calls is not False)
        gen = GenerateRequest(self._engine_id(), messages=tuple(messages), params=params,
                              tools=tuple(template_tools) if template_tools else None,
                              params_given=given_fields(body))
        return await self._answer([gen], reply, body.stream, "messages")

    async def _completions(self, request: Request) -> Response:
        body = parse(CompletionRequest, await self._json(request))
        self._check_model(body.model)
        guide, guide_param = guide_of(body)
        params = sampling_params(body, guide, guide_param)
        reply = Reply(False, self.server.model_name, body.n, body.logprobs is not None,
                       bool(body.stream_options and body.stream_options.include_usage), guide_param)
        given = given_fields(body)
        gens = [GenerateRequest(self._engine_id(), prompt=p, params=params, params_given=given) if isinstance(p, str)
                else GenerateRequest(self._engine_id(), prompt_token_ids=p, params=params, params_given=given)
                for p in completion_prompts(body)]
        return await self._answer(gens, reply, body.stream, "prompt")

    def _engine_id(self) -> str:
        return f"http{next(self._ids)}"

    # ---- answering ------------------------------------------------------------------------

    async def _answer(self, gens: list[GenerateRequest], reply: Reply, stream: bool, prompt_param: str) -> Response:
        reply.id = ("chatcmpl-" if reply.chat else "cmpl-") + uuid.uuid4().hex
        streams = [self.server.engine.generate(g) for g in gens]
        self.in_flight += 1
        try:
            for events in streams:  # each first event is `accepted` or the refusal, with its status
                first = await anext(events)
                if isinstance(first, Error):
                    raise _engine_error(first.code, first.message, first.retry_after_s, prompt_param,
                                        reply.guide_param)
            self.server.counters["openai_requests"] += 1
        except BaseException:
            self.in_flight -= 1
            for events in streams:
                await events.aclose()
            raise
        if stream:
            return StreamingResponse(self._sse(streams, reply, prompt_param), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-store"})
        try:
            return JSONResponse(await self._collect(streams, reply, prompt_param))
        finally:
            self.in_flight -= 1

    async def _collect(self, streams: list[Any], reply: Reply, prompt_param: str) -> dict[str, Any]:
        choices = new_choices(len(streams) * reply.n, reply)
        usages: list[Usage] = []
        async for prompt_index, event in _merged(streams):
            self._on_event(prompt_index, event, reply, choices, usages, prompt_param)
        tokenizer = self.server.engine.tokenizer if reply.logprobs else None
        return {"id": reply.id, "object": "chat.completion" if reply.chat else "text_completion",
                "created": reply.created, "model": reply.model,
                "choices": [chat_choice(i, c, tokenizer, reply) if reply.chat else completion_choice(i, c, tokenizer)
                            for i, c in enumerate(choices)],
                "usage": usage_of(usages), "timings": timings_of(usages)}

    async def _sse(self, streams: list[Any], reply: Reply, prompt_param: str) -> AsyncIterator[str]:
        choices = new_choices(len(streams) * reply.n, reply)
        usages: list[Usage] = []
        tokenizer = self.server.engine.tokenizer if reply.logprobs else None
        try:
            if reply.chat:
                yield self._chunk(reply, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None} for i in range(len(choices))])
            async for prompt_index, event in _merged(streams):
                try:
                    ended = self._on_event(prompt_index, event, reply, choices, usages, prompt_param)
                except OpenAIError as exc:
                    yield f"data: {json.dumps(exc.body())}\n\n"
                    break
                if isinstance(event, Token) and (event.text or reply.logprobs):
                    index = prompt_index * reply.n + event.index
                    choice = choices[index]
                    offset = choice.chars - len(event.text)  # text before this chunk
                    logprobs = logprobs_of(reply.chat, event.logprobs or (), tokenizer, offset) if tokenizer else None
                    text, calls = choice.tool_calls.push(event.text) if choice.tool_calls else (event.text, [])
                    delta = {"delta": {"content": text}} if reply.chat else {"text": text}
                    if text or logprobs:
                        yield self._chunk(reply, [{"index": index, **delta, "logprobs": logprobs,
                                                   "finish_reason": None}])
                    for call in calls:
                        yield self._chunk(reply, [{"index": index, "delta": call_delta(call), "logprobs": None,
                                                   "finish_reason": None}])
                for index in ended:
                    for delta in end_of_calls(choices[index]):
                        yield self._chunk(reply, [{"index": index, "delta": delta, "logprobs": None,
                                                   "finish_reason": None}])
                    done = {"delta": {}} if reply.chat else {"text": ""}
                    last = {"timings": timings_of(usages)} if len(usages) == len(streams) else {}
                    yield self._chunk(reply, [{"index": index, **done, "logprobs": None,
                                               "finish_reason": choices[index].finish_reason}], extra=last)
            else:
                if reply.include_usage:
                    yield self._chunk(reply, [], usage=usage_of(usages), extra={"timings": timings_of(usages)})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def _chunk(self, reply: Reply, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               extra: dict[str, Any] | None = None) -> str:
        obj: dict[str, Any] = {"id": reply.id, "object": "chat.completion.chunk" if reply.chat else "text_completion",
                               "created": reply.created, "model": reply.model, "choices": choices}
        if reply.include_usage:
            obj["usage"] = usage
        return f"data: {json.dumps({**obj, **(extra or {})})}\n\n"

    def _on_event(self, prompt_index: int, event: Event, reply: Reply, choices: list[Choice],
                  usages: list[Usage], prompt_param: str) -> list[int]:
        """Fold one engine event into the choices; returns the indexes of the choices it ended."""
        base = prompt_index * reply.n
        if isinstance(event, Error):
            raise _engine_error(event.code, event.message, event.retry_after_s, prompt_param)
        if isinstance(event, Token):
            choice = choices[base + event.index]
            choice.text.append(event.text)
            choice.chars += len(event.text)
            choice.logprobs.extend(event.logprobs or ())
            self.server.counters["tokens_streamed"] += len(event.token_ids)
            return []
        if not isinstance(event, Finished):
            return []
        usages.append(event.usage)
        self.server.metrics.observe(event.usage)
        reasons = [c["finish_reason"] for c in event.choices] if event.choices else [event.finish_reason]
        for j, reason in enumerate(reasons):
            choices[base + j].finish_reason = _FINISH_REASONS.get(reason, reason)
        return [base + j for j in range(len(reasons))]


async def _merged(streams: list[Any]) -> AsyncIterator[tuple[int, Event]]:
    """(prompt index, event) from every stream as they come. Leaving early (a disconnect) closes
    every engine stream: the requests are cancelled. A lone stream (one prompt, the usual
    request) is read in place; several are pumped into one queue by a task each."""
    if len(streams) == 1:
        async with contextlib.aclosing(_ended_by_errors(streams[0])) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

    async def pump(index: int, events: Any) -> None:
        async with contextlib.aclosing(_ended_by_errors(events)) as guarded:
            async for event in guarded:
                await queue.put((index, event))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, event = await queue.get()
            if event is None:
                remaining -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _ended_by_errors(events: Any) -> AsyncIterator[Event]:
    """A request's engine events, closed with this generator; an engine stream that raises ends
    with an Error event instead (an engine failure ends this request with a 500, never the server)."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except RequestError as exc:
        yield Error("", exc.code, exc.message, exc.retry_after_s)
    except Exception as exc:
        yield Error("", INTERNAL, f"{type(exc).__name__}: {exc}")


def _engine_error(code: str, message: str, retry_after_s: float | None, prompt_param: str,
                  guide_param: str | None = None) -> OpenAIError:
    if code == PROMPT_TOO_LONG:
        return OpenAIError(400, message, "invalid_request_error", prompt_param, "context_length_exceeded")
    if code == INVALID_PARAMS:
        param = message.split(" ", 1)[0]
        if param == "guide:" and guide_param:  # a guide the grammar library refused (core.guides)
            return invalid(guide_param, guide_param + message[len("guide"):])
        return OpenAIError(400, message, "invalid_request_error", param, None)
    if code == OVERLOADED:
        return OpenAIError(429, message, "rate_limit_error", None, "rate_limit_exceeded", retry_after_s or 1.0)
    if code == ENGINE_CLOSED:
        return OpenAIError(503, message, "server_error", None, "service_unavailable", 1.0)
    return OpenAIError(500, message, "server_error", None, code)


