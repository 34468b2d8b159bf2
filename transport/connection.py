"""One websocket connection of the server: its hello, its multiplexed requests (one pump task
each, reading the engine's event stream), its bounded outbox, and the request life cycle of
docs/PROTOCOL.md, kept in one place (`Connection._end`). See transport.server for the whole."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Protocol

from edgeinfer.core.events import SLOW_READER, Accepted, Error, Event, Finished, RequestError, Token
from edgeinfer.core.request import GenerateRequest
from transport import auth
from transport import protocol as wire
from transport.metrics import ServerMetrics
from transport.server_config import CLOSE_POLICY, EngineLike, ServerConfig
from transport.websocket import PeerClosed, WebSocketPeer

log = logging.getLogger("edgeinfer.server")


class ServerSide(Protocol):
    """What a connection reads of its server (transport.server.Server)."""

    config: ServerConfig
    engine: EngineLike
    counters: Counter[str]
    model_name: str
    draining: bool
    metrics: ServerMetrics


def stats_dict(stats: Any) -> dict[str, Any]:
    if hasattr(stats, "to_dict"):
        return dict(stats.to_dict())
    if is_dataclass(stats):
        return asdict(stats)
    return dict(stats) if isinstance(stats, Mapping) else {}


class SlowReader(Exception):
    """The connection's outbox is full: its client does not read fast enough."""


class Outbox:
    """Frames waiting for the connection's writer. Bounded, except terminal frames (one per request)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._frames: deque[str | bytes] = deque()
        self._ready = asyncio.Event()

    def put(self, frame: str | bytes, force: bool = False) -> None:
        if not force and len(self._frames) >= self.limit:
            raise SlowReader
        self._frames.append(frame)
        self._ready.set()

    @property
    def pending(self) -> int:
        return len(self._frames)

    async def get(self) -> str | bytes:
        while not self._frames:
            self._ready.clear()
            await self._ready.wait()
        return self._frames.popleft()


@dataclass
class RequestState:
    """Mutable, written by the request's pump task, and by `_cancel` (cancel_requested only)."""

    task: asyncio.Task[None] | None = None
    state: str = "submitted"  # submitted | queued | running
    queue_position: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancel_requested: bool = False  # a cancel came before `accepted`: honoured when it comes
    ended: bool = False  # its terminal frame is queued and its id free


class Connection:
    def __init__(self, server: ServerSide, ws: WebSocketPeer, number: int, handshake_auth: bool) -> None:
        self.server = server
        self.config = server.config
        self.ws = ws
        self.number = number
        self.authenticated = handshake_auth
        self.binary = False  # answer in the encoding of the hello frame
        self.outbox = Outbox(self.config.send_queue_frames)
        self.requests: dict[str, RequestState] = {}
        self.closing = False  # a fatal error was answered: later frames are not read

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop())
        try:
            if await self._hello():
                while True:
                    self._on_frame(await self.ws.recv())
        except PeerClosed:
            pass
        finally:
            tasks = [r.task for r in self.requests.values() if r.task is not None]
            for task in tasks:
                task.cancel()  # client gone (or server closing): close every stream, freeing its blocks
            await asyncio.gather(*tasks, return_exceptions=True)
            if not self.ws.close_code:
                await self._flush(timeout_s=1.0)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _flush(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.outbox.pending and time.monotonic() < deadline and self.ws.close_code is None:
            await asyncio.sleep(0.01)

    async def _write_loop(self) -> None:
        with contextlib.suppress(PeerClosed):
            while True:
                await self.ws.send(await self.outbox.get())

    async def _hello(self) -> bool:
        try:
            frame = await asyncio.wait_for(self.ws.recv(), self.config.hello_timeout_s)
        except asyncio.TimeoutError:
            await self._refuse(wire.HELLO_REQUIRED, f"no hello within {self.config.hello_timeout_s:g} s",
                               False)
            return False
        self.binary = isinstance(frame, bytes)
        try:
            msg = wire.parse_frame(frame, self.config.max_frame_bytes)
        except wire.ProtocolError as exc:
            await self._refuse(exc.code, f"the first frame must be a valid hello: {exc.message}", self.binary)
            return False
        if not isinstance(msg, wire.Hello):
            await self._refuse(wire.HELLO_REQUIRED, 'the first frame must be {"type": "hello", ...}',
                               self.binary)
            return False
        if msg.token is not None or not self.authenticated:
            if not auth.token_matches(msg.token, self.config.token):
                self.server.counters["refused_token"] += 1
                await self._refuse(wire.UNAUTHORIZED, "missing or wrong token", self.binary)
                return False
        self.authenticated = True
        self._send({"type": "welcome", "version": wire.PROTOCOL_VERSION, "server": "edgeinfer",
                    "model": self.server.model_name,
                    "limits": {"max_frame_bytes": self.config.max_frame_bytes,
                               "max_requests": self.config.max_requests_per_connection}})
        return True

    def _close_after(self, code: str, message: str) -> None:
        """Answer a fatal error, then close with 1008 once the frames before it are out."""
        self.closing = True
        self._send_error(code, message, force=True)

        async def close() -> None:
            await self._flush(timeout_s=1.0)
            await self.ws.close(CLOSE_POLICY, code)

        asyncio.get_running_loop().create_task(close())

    async def _refuse(self, code: str, message: str, binary: bool) -> None:
        self.server.counters[f"error:{code}"] += 1
        with contextlib.suppress(PeerClosed):
            await self.ws.send(wire.encode(wire.error_to_wire(code, message), binary))
            await self.ws.close(CLOSE_POLICY, code)

    def _send(self, obj: Mapping[str, Any], force: bool = False) -> None:
        self.outbox.put(wire.encode(obj, self.binary), force)

    def _send_error(self, code: str, message: str, request_id: str | None = None,
                    retry_after_s: float | None = None, force: bool = False) -> None:
        self.server.counters[f"error:{code}"] += 1
        self._send(wire.error_to_wire(code, message, request_id, retry_after_s), force)

    def _on_frame(self, frame: str | bytes) -> None:
        if self.closing:
            return
        try:
            try:
                msg = wire.parse_frame(frame, self.config.max_frame_bytes)
            except wire.ProtocolError as exc:
                if exc.fatal:  # a second hello with another version: as at the first hello
                    self._close_after(exc.code, exc.message)
                else:
                    self._send_error(exc.code, exc.message, exc.request_id)
                return
            if isinstance(msg, (wire.Generate, wire.Chat)):
                self._start(msg)
            elif isinstance(msg, wire.Cancel):
                self._cancel(msg.id)
            elif isinstance(msg, wire.Status):
                self._status(msg.id)
            else:
                self._send_error(wire.INVALID_MESSAGE, "hello may be sent only once")
        except SlowReader:
            # The client sends but does not read our answers: nothing more can be said to it.
            self.server.counters["error:slow_reader"] += 1
            closing = self.ws.close(CLOSE_POLICY, "client does not read its events")
            asyncio.get_running_loop().create_task(closing)

    def _start(self, msg: wire.Generate | wire.Chat) -> None:
        if self.server.draining:
            self._send_error(wire.SHUTTING_DOWN, "the server is shutting down; retry later", msg.id, 1.0)
            return
        if msg.id in self.requests:
            self._send_error(wire.DUPLICATE_ID,
                             f"request id {msg.id!r} is already in flight on this connection", msg.id)
            return
        if len(self.requests) >= self.config.max_requests_per_connection:
            self._send_error(wire.TOO_MANY_REQUESTS, f"at most {self.config.max_requests_per_connection} "
                             "requests in flight per connection", msg.id)
            return
        engine_id = f"c{self.number}:{msg.id}"
        if isinstance(msg, wire.Chat):
            messages = tuple({"role": m.role, "content": m.content} for m in msg.messages)
            request = GenerateRequest(engine_id, messages=messages, params=msg.params, params_given=msg.params_given)
        else:
            request = GenerateRequest(engine_id, msg.prompt, msg.prompt_token_ids, params=msg.params,
                                      params_given=msg.params_given)
        self.server.counters["requests"] += 1
        state = RequestState()
        self.requests[msg.id] = state
        state.task = asyncio.create_task(self._pump(msg.id, request, state))

    async def _pump(self, client_id: str, request: GenerateRequest, state: RequestState) -> None:
        try:
            async with contextlib.aclosing(self.server.engine.generate(request)) as events:
                async for event in events:
                    self._on_event(client_id, event, state)
                    if state.ended or (state.cancel_requested and state.state != "submitted"):
                        break  # leaving the block closes the stream: the engine frees the request
        except SlowReader:
            self._end(client_id, state, wire.error_to_wire(
                SLOW_READER, "the client read too slowly; request cancelled after "
                f"{self.config.send_queue_frames} unsent frames", client_id), SLOW_READER)
        except RequestError as exc:
            self._end(client_id, state, wire.error_to_wire(exc.code, exc.message, client_id, exc.retry_after_s),
                      exc.code)
        except Exception as exc:  # an engine failure ends this request, never the server
            log.exception("request %s failed", client_id)
            self._end(client_id, state, wire.error_to_wire("internal_error", f"{type(exc).__name__}: {exc}",
                                                           client_id), "internal_error")
        finally:  # not ended: cancelled (by `cancel`, a disconnect or shutdown)
            self._end(client_id, state, {"type": "done", "id": client_id, "finish_reason": "cancelled",
                                         "usage": {"prompt_tokens": state.prompt_tokens,
                                                   "completion_tokens": state.completion_tokens}})

    def _on_event(self, client_id: str, event: Event, state: RequestState) -> None:
        if isinstance(event, Accepted):
            state.state, state.queue_position = "queued", event.queue_position
            state.prompt_tokens = event.prompt_tokens
        elif isinstance(event, Token):
            state.state, state.queue_position = "running", 0
            state.completion_tokens += len(event.token_ids)
            self.server.counters["tokens_streamed"] += len(event.token_ids)
        if isinstance(event, Finished):
            self.server.metrics.observe(event.usage)
        if isinstance(event, (Finished, Error)):
            self._end(client_id, state, wire.event_to_wire(event, client_id),
                      event.code if isinstance(event, Error) else None)
        else:
            self._send(wire.event_to_wire(event, client_id))

    def _end(self, client_id: str, state: RequestState, frame: Mapping[str, Any],
             error_code: str | None = None) -> None:
        """The one place a request ends: its terminal frame, once, and its id freed with it."""
        if state.ended:
            return
        state.ended = True
        if error_code is not None:
            self.server.counters[f"error:{error_code}"] += 1
        self._send(frame, force=True)
        if self.requests.get(client_id) is state:
            del self.requests[client_id]

    def _cancel(self, client_id: str) -> None:
        state = self.requests.get(client_id)
        if state is None or state.task is None:
            self._unknown_id(client_id)
        elif state.state == "submitted":
            state.cancel_requested = True  # the pump cancels it as soon as the engine answers
        else:
            state.task.cancel()  # the pump's finally answers `done` with finish_reason "cancelled"

    def _status(self, client_id: str | None) -> None:
        if client_id is not None and client_id not in self.requests:
            self._unknown_id(client_id)
            return
        rows = [{"id": rid, "state": r.state, "queue_position": r.queue_position,
                 "completion_tokens": r.completion_tokens}
                for rid, r in self.requests.items() if client_id in (None, rid)]
        self._send({"type": "status", "id": client_id, "requests": rows,
                    "engine": _plain(stats_dict(self.server.engine.stats()))})

    def _unknown_id(self, client_id: str) -> None:
        self._send_error(wire.UNKNOWN_ID, f"no request {client_id!r} in flight on this connection", client_id)


def _plain(value: Any) -> Any:
    """Engine stats as JSON/msgpack-safe data (numbers, strings, lists, string-keyed maps)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
