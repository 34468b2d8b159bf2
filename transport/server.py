"""The websocket server: connections, multiplexed request streams, limits, HTTP side routes.

One `Server` serves one engine. Each connection is a `_Connection` that alone writes its state
(its requests, its outbox); each request is a pump task that reads the engine's event stream
and puts frames into the connection's bounded outbox without ever waiting on the client, so a
slow reader can neither stall the engine nor other clients: when its outbox is full the request
is closed (which frees its KV blocks in the engine) and answered with `slow_reader`. Closing a
request's event stream is the only way a request is cancelled: on `cancel`, on disconnect and
on shutdown alike. Plain HTTP on the same port (websockets' process_request hook): `/healthz`
(the engine's health: 200, or 503 with the reason), `/metrics` (Prometheus text) and the chat
page at `/`.

A request's life cycle (docs/PROTOCOL.md), enforced here and only here: its first frame is
`accepted` or a terminal `error`; tokens follow `accepted`; exactly one terminal frame (`done` or
`error`) ends it, queued by `_Connection._end`, which also frees the id in the same breath, so
the id is reusable by the time the client reads that frame. A `cancel` that arrives before the
engine has answered is held until it does (the request is then cancelled at once), so even a
request cancelled a millisecond after it was sent gets `accepted`, then `done` (cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from http import HTTPStatus
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from edgeinfer.core.events import SLOW_READER, Accepted, Error, Event, Finished, Health, RequestError, Token
from edgeinfer.core.sampling_params import SamplingParams
from transport import auth
from transport import protocol as wire

log = logging.getLogger("edgeinfer.server")

CLOSE_POLICY = 1008  # RFC 6455: policy violation (bad token, no hello, unreadable client)
CLOSE_GOING_AWAY = 1001
CLOSE_TRY_AGAIN = 1013
HARD_FRAME_FACTOR = 4  # frames up to this many times the limit are answered; larger ones close (1009)


@dataclass(frozen=True)
class ServerConfig:
    token: str
    host: str = "127.0.0.1"
    port: int = 8765  # 0: any free port (tests)
    max_frame_bytes: int = 1 << 20
    max_connections: int = 128
    max_requests_per_connection: int = 16
    send_queue_frames: int = 1024  # per connection; past it the request that overflows is cancelled
    hello_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    allowed_origins: tuple[str, ...] = ()  # origins besides the server's own page

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ValueError("ServerConfig.token must be at least 16 characters (see transport.auth)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port}")
        for name in ("max_frame_bytes", "max_connections", "max_requests_per_connection",
                     "send_queue_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hello_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("ServerConfig.hello_timeout_s must be > 0 and drain_timeout_s >= 0")


class EngineLike(Protocol):
    """What the server needs of edgeinfer.engine.api.Engine (and transport.echo_engine.EchoEngine)."""

    def generate(self, request: Any) -> AsyncIterator[Event]: ...

    def stats(self) -> Any: ...

    def health(self) -> Health: ...


# (engine request id, prompt, prompt_token_ids, messages, params) -> the engine's request object
RequestFactory = Callable[[str, "str | None", "tuple[int, ...] | None", "tuple[dict[str, str], ...] | None",
                           SamplingParams], Any]


def engine_request_factory(request_id: str, prompt: str | None, prompt_token_ids: tuple[int, ...] | None,
                           messages: tuple[dict[str, str], ...] | None, params: SamplingParams) -> Any:
    from edgeinfer.engine.api import GenerateRequest  # the real engine only when one is served

    return GenerateRequest(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                           messages=messages, params=params)


def stats_dict(stats: Any) -> dict[str, Any]:
    if hasattr(stats, "to_dict"):
        return dict(stats.to_dict())
    if is_dataclass(stats):
        return asdict(stats)
    return dict(stats) if isinstance(stats, Mapping) else {}


class Server:
    """`async with Server(engine, config) as server:` listens until the block ends or `drain()`."""

    def __init__(self, engine: EngineLike, config: ServerConfig,
                 request_factory: RequestFactory | None = None, model_name: str = "") -> None:
        self.engine = engine
        self.config = config
        self.request_factory = request_factory or engine_request_factory
        self.model_name = model_name
        self.connections: set[_Connection] = set()
        self.counters: Counter[str] = Counter()  # monotonically increasing, for /metrics
        self.draining = False
        self._ws: WsServer | None = None
        self._hosts: frozenset[str] = frozenset()
        self._ids = itertools.count(1)
        self._page = resources.files("transport").joinpath("static/chat.html").read_bytes()

    @property
    def port(self) -> int:
        assert self._ws is not None, "server not started"
        return self._ws.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}/ws"

    async def __aenter__(self) -> Server:
        cfg = self.config
        self._ws = await serve(
            self._handle, cfg.host, cfg.port, process_request=self._process_request,
            max_size=cfg.max_frame_bytes * HARD_FRAME_FACTOR, compression=None, server_header="edgeinfer",
            max_queue=32, logger=logging.getLogger("edgeinfer.server.ws"))
        self._hosts = auth.allowed_hosts(cfg.host, self.port)
        log.info("listening on %s (page http://%s:%d/)", self.url, cfg.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain(0)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish for up to timeout_s, then close everything."""
        if self._ws is None:
            return
        self.draining = True
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self._ws.server.close()  # the asyncio server: stop listening; open connections carry on
        deadline = time.monotonic() + timeout_s
        while any(c.requests for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._ws.close(close_connections=True, code=CLOSE_GOING_AWAY, reason="server shutting down")
        await self._ws.wait_closed()
        self._ws = None

    async def serve_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        await self.drain()

    # ---- HTTP side ------------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        host = request.headers.get("Host")
        if not auth.host_allowed(host, self._hosts):
            self.counters["refused_host"] += 1
            return connection.respond(HTTPStatus.FORBIDDEN, "Host header does not name this server\n")
        if path == "/healthz":
            health = self.engine.health()
            if health.ok:
                return connection.respond(HTTPStatus.OK, "ok\n")
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"{health.status}: {health.reason}\n")
        if path == "/metrics":
            response = connection.respond(HTTPStatus.OK, self.metrics_text())
            _set_header(response.headers, "Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            return response
        if path in ("/", "/index.html"):
            return self._page_response(connection)
        if path != "/ws":
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        origin = request.headers.get("Origin")
        if not auth.origin_allowed(origin, host, self._hosts, self.config.allowed_origins):
            self.counters["refused_origin"] += 1
            return connection.respond(HTTPStatus.FORBIDDEN, "Origin is not this server's page\n")
        given = _handshake_token(request)
        if given is not None and not auth.token_matches(given, self.config.token):
            self.counters["refused_token"] += 1
            return connection.respond(HTTPStatus.UNAUTHORIZED, "wrong token\n")
        if self.draining:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "server shutting down\n")
        if len(self.connections) >= self.config.max_connections:
            self.counters["refused_connections"] += 1
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"connection limit reached ({self.config.max_connections})\n")
        return None

    def _page_response(self, connection: ServerConnection) -> Response:
        response = connection.respond(HTTPStatus.OK, "")
        response.body = self._page
        headers = response.headers
        _set_header(headers, "Content-Type", "text/html; charset=utf-8")
        _set_header(headers, "Content-Length", str(len(self._page)))
        # The page holds no secret (the token travels in the URL fragment), but it must not be framed
        # (clickjacking) nor load anything from elsewhere.
        _set_header(headers, "Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; "
                    "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; frame-ancestors 'none'; "
                    "base-uri 'none'; form-action 'none'")
        _set_header(headers, "X-Frame-Options", "DENY")
        _set_header(headers, "Referrer-Policy", "no-referrer")
        _set_header(headers, "Cache-Control", "no-store")
        _set_header(headers, "X-Content-Type-Options", "nosniff")
        return response

    def metrics_text(self) -> str:
        lines = [
            "# TYPE edgeinfer_connections gauge", f"edgeinfer_connections {len(self.connections)}",
            "# TYPE edgeinfer_active_requests gauge",
            f"edgeinfer_active_requests {sum(len(c.requests) for c in self.connections)}",
        ]
        for name in sorted(k for k in self.counters if not k.startswith("error:")):
            lines += [f"# TYPE edgeinfer_{name}_total counter",
                      f"edgeinfer_{name}_total {self.counters[name]}"]
        lines.append("# TYPE edgeinfer_errors_total counter")
        for key in sorted(k for k in self.counters if k.startswith("error:")):
            lines.append(f'edgeinfer_errors_total{{code="{key[6:]}"}} {self.counters[key]}')
        for name, value in sorted(stats_dict(self.engine.stats()).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lines += [f"# TYPE edgeinfer_engine_{name} gauge", f"edgeinfer_engine_{name} {value}"]
        return "\n".join(lines) + "\n"

    # ---- websocket side -------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        conn = _Connection(self, ws, next(self._ids), _handshake_token(ws.request) is not None)
        self.connections.add(conn)
        self.counters["connections"] += 1
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)


def _set_header(headers: Headers, name: str, value: str) -> None:
    if name in headers:
        del headers[name]  # Headers is a multidict: replace, don't add a second value
    headers[name] = value


def _handshake_token(request: Request | None) -> str | None:
    if request is None:
        return None
    bearer = request.headers.get("Authorization", "")
    if bearer.lower().startswith("bearer "):
        return bearer[7:].strip()
    values = parse_qs(urlsplit(request.path).query).get("token")
    return values[0] if values else None


class _SlowReader(Exception):
    """The connection's outbox is full: its client does not read fast enough."""


class _Outbox:
    """Frames waiting for the connection's writer. Bounded, except terminal frames (one per request)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._frames: deque[str | bytes] = deque()
        self._ready = asyncio.Event()

    def put(self, frame: str | bytes, force: bool = False) -> None:
        if not force and len(self._frames) >= self.limit:
            raise _SlowReader
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
class _RequestState:
    """Mutable, written by the request's pump task, and by `_cancel` (cancel_requested only)."""

    task: asyncio.Task[None] | None = None
    state: str = "submitted"  # submitted | queued | running
    queue_position: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancel_requested: bool = False  # a cancel came before `accepted`: honoured when it comes
    ended: bool = False  # its terminal frame is queued and its id free


class _Connection:
    def __init__(self, server: Server, ws: ServerConnection, number: int, handshake_auth: bool) -> None:
        self.server = server
        self.config = server.config
        self.ws = ws
        self.number = number
        self.authenticated = handshake_auth
        self.binary = False  # answer in the encoding of the hello frame
        self.outbox = _Outbox(self.config.send_queue_frames)
        self.requests: dict[str, _RequestState] = {}
        self.closing = False  # a fatal error was answered: later frames are not read

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop())
        try:
            if await self._hello():
                async for frame in self.ws:
                    self._on_frame(frame)
        except ConnectionClosed:
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
        with contextlib.suppress(ConnectionClosed):
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
        with contextlib.suppress(ConnectionClosed):
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
        except _SlowReader:
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
        make = self.server.request_factory
        if isinstance(msg, wire.Chat):
            messages = tuple({"role": m.role, "content": m.content} for m in msg.messages)
            request = make(engine_id, None, None, messages, msg.params)
        else:
            request = make(engine_id, msg.prompt, msg.prompt_token_ids, None, msg.params)
        self.server.counters["requests"] += 1
        state = _RequestState()
        self.requests[msg.id] = state
        state.task = asyncio.create_task(self._pump(msg.id, request, state))

    async def _pump(self, client_id: str, request: Any, state: _RequestState) -> None:
        try:
            async with contextlib.aclosing(self.server.engine.generate(request)) as events:
                async for event in events:
                    self._on_event(client_id, event, state)
                    if state.ended or (state.cancel_requested and state.state != "submitted"):
                        break  # leaving the block closes the stream: the engine frees the request
        except _SlowReader:
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

    def _on_event(self, client_id: str, event: Event, state: _RequestState) -> None:
        if isinstance(event, Accepted):
            state.state, state.queue_position = "queued", event.queue_position
            state.prompt_tokens = event.prompt_tokens
        elif isinstance(event, Token):
            state.state, state.queue_position = "running", 0
            state.completion_tokens += len(event.token_ids)
            self.server.counters["tokens_streamed"] += len(event.token_ids)
        if isinstance(event, (Finished, Error)):
            self._end(client_id, state, wire.event_to_wire(event, client_id),
                      event.code if isinstance(event, Error) else None)
        else:
            self._send(wire.event_to_wire(event, client_id))

    def _end(self, client_id: str, state: _RequestState, frame: Mapping[str, Any],
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
