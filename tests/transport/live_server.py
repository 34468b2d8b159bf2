"""A real server on the default model, running on its own event loop thread, for tests that
drive it from many examples (hypothesis) or need HTTP and websocket clients at once.

The engine's task group must be entered and left by one task, so the server lives in one
long-running coroutine on a background loop; tests submit coroutines to that loop with `run`.
Clients here speak raw JSON frames (websockets only), as an independent client written from
docs/PROTOCOL.md would, not through transport.client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from edgeinfer.config import RuntimeConfig
from transport.server import Server, ServerConfig
from transport.service import open_engine

TOKEN = "test-token-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the default model's served name


class LiveServer:
    """`LiveServer(open_engine)`: open_engine() is an async context manager yielding an engine."""

    def __init__(self, open_engine: Any, model_name: str = "", **config: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="live-server", daemon=True)
        self._thread.start()
        self._open_engine = open_engine
        self._config = config
        self.model_name = model_name
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._main = asyncio.run_coroutine_threadsafe(self._serve(), self.loop)
        while not self._ready.wait(0.1):
            if self._main.done():
                self._main.result()  # raises what failed the start
        self.url = f"ws://127.0.0.1:{self.port}/ws"

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self._open_engine() as engine:
            self.engine = engine
            async with Server(engine, ServerConfig(token=TOKEN, port=0, **self._config), self.model_name) as server:
                self.server = server
                self.port = server.port
                self._ready.set()
                await self._stop.wait()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), self.loop).result()

    def close(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._main.result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def open_client(url: str, binary: bool = False) -> ClientConnection:
    """A connected, welcomed websocket (hello in JSON, or msgpack when binary)."""
    ws = await ws_connect(url, max_size=None)
    await send(ws, {"type": "hello", "version": "edgeinfer/1", "token": TOKEN})
    welcome = await receive(ws)
    assert welcome["type"] == "welcome", welcome
    return ws


async def send(ws: ClientConnection, obj: dict[str, Any]) -> None:
    await ws.send(json.dumps(obj))


async def receive(ws: ClientConnection, timeout_s: float = 30.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


async def http_get(port: int, path: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    host = host or f"127.0.0.1:{port}"
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    # Header names are case-insensitive (uvicorn sends them in lower case): keyed here as "Content-Type".
    headers = {name.title(): value for name, value in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def check_life_cycles(frames: list[dict[str, Any]], num_generates: dict[str, int]) -> None:
    """The invariant of docs/PROTOCOL.md over one connection's frames: per id, each request is
    `accepted token* (done | error)` or a single refusal `error`, requests of one id follow one
    another (an id is reused only after its terminal frame), `unknown_id` errors (a cancel of an
    id not in flight) fall between requests; and each id ran exactly as many requests as were
    sent with it. No internal_error, no engine_closed."""
    in_flight: dict[str, str] = {}  # id -> "accepted"
    ended: dict[str, int] = {}
    for frame in frames:
        rid, kind = frame.get("id"), frame["type"]
        if kind in ("status", "welcome"):
            continue
        assert frame.get("code") not in ("internal_error", "engine_closed"), frame
        if kind == "error" and frame["code"] == "unknown_id":
            assert rid not in in_flight, f"unknown_id for {rid!r} while it is in flight: {frame}"
            continue
        if kind == "accepted":
            assert rid not in in_flight, f"a second accepted for {rid!r}"
            in_flight[rid] = "accepted"
        elif kind == "token":
            assert in_flight.get(rid) == "accepted", f"a token for {rid!r} outside accepted..done: {frame}"
        elif kind in ("done", "error"):
            in_flight.pop(rid, None)
            ended[rid] = ended.get(rid, 0) + 1
        else:
            raise AssertionError(f"unexpected frame {frame}")
    assert not in_flight, f"requests never ended: {sorted(in_flight)}"
    assert ended == {k: v for k, v in num_generates.items() if v}, (ended, num_generates)


def serve_model(model_path: str | Path, runtime: RuntimeConfig | None = None) -> LiveServer:
    """A LiveServer of the real engine on ``model_path``, as `edgeinfer serve` opens it."""

    @contextlib.asynccontextmanager
    async def engine() -> AsyncIterator[Any]:
        async with open_engine(str(model_path), runtime or RuntimeConfig()) as (opened, _):
            yield opened

    return LiveServer(engine, model_name=MODEL)
