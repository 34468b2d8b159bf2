"""The server: an ASGI app served by uvicorn in-process, with the edgeinfer/1 websocket at `/ws`
(connections, multiplexed request streams, limits) and HTTP routes on the same port.

One `Server` serves one engine. Each connection is a `Connection` that alone writes its state
(its requests, its outbox); each request is a pump task that reads the engine's event stream
and puts frames into the connection's bounded outbox without ever waiting on the client, so a
slow reader can neither stall the engine nor other clients: when its outbox is full the request
is closed (which frees its KV blocks in the engine) and answered with `slow_reader`. Closing a
request's event stream is the only way a request is cancelled: on `cancel`, on disconnect and
on shutdown alike. HTTP routes: `/healthz` (the engine's health: 200, or 503 with the reason),
`/metrics` (transport.metrics), the chat page at `/` and the OpenAI API (transport.openai_api).
Every request, HTTP or websocket, must name this server in its Host header (transport.auth),
checked before routing. uvicorn runs with
the websockets library as its websocket implementation and without its own signal handlers: the
process (transport.service) owns SIGTERM and drains through `Server.drain`.

A request's life cycle (docs/PROTOCOL.md), enforced here and only here: its first frame is
`accepted` or a terminal `error`; tokens follow `accepted`; exactly one terminal frame (`done` or
`error`) ends it, queued by `Connection._end`, which also frees the id in the same breath, so
the id is reusable by the time the client reads that frame. A `cancel` that arrives before the
engine has answered is held until it does (the request is then cancelled at once), so even a
request cancelled a millisecond after it was sent gets `accepted`, then `done` (cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from importlib import resources

import uvicorn
from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from transport import auth
from transport.connection import Connection, stats_dict
from transport.metrics import CONTENT_TYPE, ServerMetrics
from transport.openai_api import OpenAIApi
from transport.server_config import CLOSE_GOING_AWAY, HARD_FRAME_FACTOR, EngineLike, ServerConfig
from transport.websocket import AsgiWebSocket

log = logging.getLogger("edgeinfer.server")

# The page holds no secret (the token travels in the URL fragment), but it must not be framed
# (clickjacking) nor load anything from elsewhere.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
}
# In-flight HTTP responses still open this long after the drain are cancelled (their streams closed).
_HTTP_SHUTDOWN_GRACE_S = 1.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the service owns SIGTERM/SIGINT and calls `drain`."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket; an OSError naming the address when it cannot be had (port in use).

    Made with proto IPPROTO_TCP, not socket.create_server's 0: asyncio turns Nagle's algorithm
    off (TCP_NODELAY) only on connections whose socket says TCP, and accepted sockets copy the
    listener's proto. With Nagle on, a stream's first token chunk waited behind the response
    headers for the client's delayed ACK: a 4-token prompt's first token reached the client
    ~21 ms after the engine had it (docs/BENCHMARKS.md, 2026-11-27)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name != "nt":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen()
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror} "
                      "(another server there? choose another --port)") from exc
    return sock


class Server:
    """`async with Server(engine, config) as server:` listens until the block ends or `drain()`."""

    def __init__(self, engine: EngineLike, config: ServerConfig, model_name: str = "",
                 sock: socket.socket | None = None) -> None:
        """sock: a socket already bound to config's address (the service binds before loading the model)."""
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.connections: set[Connection] = set()
        self.counters: Counter[str] = Counter()  # monotonically increasing, for /metrics
        self.metrics = ServerMetrics(self.counters, self._gauges, lambda: stats_dict(self.engine.stats()))
        self.draining = False
        self.openai = OpenAIApi(self)
        self.app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, routes=[
            Route("/healthz", self._healthz), Route("/metrics", self._metrics),
            Route("/", self._page), Route("/index.html", self._page), WebSocketRoute("/ws", self._websocket),
            *self.openai.routes(),
        ], exception_handlers={404: _not_found})
        self._sock = sock
        self._uvicorn: _Uvicorn | None = None
        self._serving: asyncio.Task[None] | None = None
        self._port = 0
        self.allowed_hosts: frozenset[str] = frozenset()  # Host header values naming this server
        self._ids = itertools.count(1)
        self._page_bytes = resources.files("transport").joinpath("static/chat.html").read_bytes()

    @property
    def port(self) -> int:
        assert self._port, "server not started"
        return self._port

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}/ws"

    async def __aenter__(self) -> Server:
        cfg = self.config
        sock = self._sock or bind_socket(cfg.host, cfg.port)
        self._port = sock.getsockname()[1]
        self.allowed_hosts = auth.allowed_hosts(cfg.host, self._port)
        self._uvicorn = _Uvicorn(uvicorn.Config(
            self._check_host, interface="asgi3", ws="websockets", ws_max_size=cfg.max_frame_bytes * HARD_FRAME_FACTOR,
            ws_max_queue=32, ws_per_message_deflate=False, lifespan="off", log_config=None,
            access_log=False, server_header=False, headers=[("server", "edgeinfer")],
            timeout_graceful_shutdown=_HTTP_SHUTDOWN_GRACE_S))
        self._serving = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._serving.done():
                self._serving.result()  # raises what failed the start
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.005)
        log.info("listening on %s (page http://%s:%d/)", self.url, cfg.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain(0)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish for up to timeout_s, then close everything."""
        if self._uvicorn is None or self._serving is None:
            return
        self.draining = True
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        for listener in self._uvicorn.servers:
            listener.close()  # stop listening; open connections carry on
        deadline = time.monotonic() + timeout_s
        while self.num_active_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.gather(*(c.ws.close(CLOSE_GOING_AWAY, "server shutting down") for c in list(self.connections)))
        self._uvicorn.should_exit = True
        await self._serving
        self._uvicorn = self._serving = None

    async def serve_until(self, stop: asyncio.Event) -> None:
        await stop.wait()
        await self.drain()

    def num_active_requests(self) -> int:
        return sum(len(c.requests) for c in self.connections) + self.openai.in_flight

    def _gauges(self) -> dict[str, float]:
        return {"connections": len(self.connections), "active_requests": self.num_active_requests()}

    # ---- HTTP side ------------------------------------------------------------------------

    async def _check_host(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app uvicorn serves: the Host check (DNS rebinding) in front of every route."""
        if scope["type"] in ("http", "websocket") and not auth.host_allowed(Headers(scope=scope).get("host"),
                                                                            self.allowed_hosts):
            self.counters["refused_host"] += 1
            refusal = PlainTextResponse("Host header does not name this server\n", 403)
            if scope["type"] == "http":
                await refusal(scope, receive, send)
            else:
                await WebSocket(scope, receive, send).send_denial_response(refusal)
            return
        await self.app(scope, receive, send)

    async def _healthz(self, request: Request) -> Response:
        health = self.engine.health()
        if health.ok:
            return PlainTextResponse("ok\n")
        return PlainTextResponse(f"{health.status}: {health.reason}\n", 503)

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    async def _page(self, request: Request) -> Response:
        return Response(self._page_bytes, media_type="text/html", headers=_PAGE_HEADERS)

    # ---- websocket side -------------------------------------------------------------------

    def _handshake_refusal(self, websocket: WebSocket) -> Response | None:
        origin = websocket.headers.get("origin")
        host = websocket.headers.get("host")
        if not auth.origin_allowed(origin, host, self.allowed_hosts, self.config.allowed_origins):
            self.counters["refused_origin"] += 1
            return PlainTextResponse("Origin is not this server's page\n", 403)
        given = _handshake_token(websocket)
        if given is not None and not auth.token_matches(given, self.config.token):
            self.counters["refused_token"] += 1
            return PlainTextResponse("wrong token\n", 401)
        if self.draining:
            return PlainTextResponse("server shutting down\n", 503)
        if len(self.connections) >= self.config.max_connections:
            self.counters["refused_connections"] += 1
            return PlainTextResponse(f"connection limit reached ({self.config.max_connections})\n", 503)
        return None

    async def _websocket(self, websocket: WebSocket) -> None:
        refusal = self._handshake_refusal(websocket)
        if refusal is not None:
            await websocket.send_denial_response(refusal)
            return
        conn = Connection(self, AsgiWebSocket(websocket), next(self._ids), _handshake_token(websocket) is not None)
        self.connections.add(conn)  # before accept's await, so concurrent handshakes see the limit
        self.counters["connections"] += 1
        try:
            await websocket.accept()
            await conn.run()
        finally:
            self.connections.discard(conn)


async def _not_found(request: Request, exc: Exception) -> Response:
    return PlainTextResponse("not found\n", 404)


def _handshake_token(websocket: WebSocket) -> str | None:
    bearer = websocket.headers.get("authorization", "")
    if bearer.lower().startswith("bearer "):
        return bearer[7:].strip()
    return websocket.query_params.get("token")
