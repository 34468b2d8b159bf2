"""The websocket server: connections, multiplexed request streams, limits, HTTP side routes.

One `Server` serves one engine. Each connection is a `Connection` that alone writes its state
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
`error`) ends it, queued by `Connection._end`, which also frees the id in the same breath, so
the id is reusable by the time the client reads that frame. A `cancel` that arrives before the
engine has answered is held until it does (the request is then cancelled at once), so even a
request cancelled a millisecond after it was sent gets `accepted`, then `done` (cancelled).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from http import HTTPStatus
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from transport import auth
from transport.connection import Connection, stats_dict
from transport.server_config import CLOSE_GOING_AWAY, HARD_FRAME_FACTOR, EngineLike, ServerConfig

log = logging.getLogger("edgeinfer.server")

class Server:
    """`async with Server(engine, config) as server:` listens until the block ends or `drain()`."""

    def __init__(self, engine: EngineLike, config: ServerConfig, model_name: str = "") -> None:
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.connections: set[Connection] = set()
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
        conn = Connection(self, ws, next(self._ids), _handshake_token(ws.request) is not None)
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


