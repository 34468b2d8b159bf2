"""Python async client for the edgeinfer/1 protocol: connect, stream generate/chat, cancel, status.

    async with connect("ws://127.0.0.1:8765/ws", token) as client:
        async for event in client.chat([{"role": "user", "content": "Hi"}], max_tokens=32):
            if event["type"] == "token": print(event["text"], end="")

Events are the wire objects of docs/PROTOCOL.md as dicts. One reader task owns the socket's
receive side and routes each event to its request's queue by id; a stream ends after its `done`
or `error`. Leaving a stream early (break, exception, cancellation) sends `cancel` for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from transport import protocol as wire

TERMINAL = ("done", "error")


class ServerError(Exception):
    """The server refused the connection or answered a connection-level error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Client:
    def __init__(self, ws: ClientConnection, binary: bool) -> None:
        self.ws = ws
        self.binary = binary
        self.welcome: dict[str, Any] = {}
        self.errors: asyncio.Queue[dict[str, Any]] = asyncio.Queue()  # events with no request id
        self._streams: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._abandoned: set[str] = set()  # streams left early: drop their events until the terminal one
        self._status: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None

    async def _hello(self, token: str | None, client_name: str) -> None:
        hello = {"type": "hello", "version": wire.PROTOCOL_VERSION, "client": client_name}
        if token is not None:
            hello["token"] = token
        await self.ws.send(wire.encode(hello, self.binary))
        first = wire.decode_event(await self.ws.recv())
        if first["type"] != "welcome":
            raise ServerError(first.get("code", first["type"]), first.get("message", ""))
        self.welcome = first
        self._reader = asyncio.create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            async for frame in self.ws:
                event = wire.decode_event(frame)
                if event["type"] == "status":
                    await self._status.put(event)
                elif event.get("id") in self._streams:
                    await self._streams[event["id"]].put(event)
                elif event.get("id") in self._abandoned:
                    if event["type"] in TERMINAL:
                        self._abandoned.discard(event["id"])
                else:
                    await self.errors.put(event)
        except ConnectionClosed:
            pass
        finally:
            # Wake every open stream: the connection is gone, so none of them will end otherwise.
            reason = f"connection closed ({self.ws.close_code} {self.ws.close_reason or ''})".strip()
            for rid, queue in self._streams.items():
                queue.put_nowait({"type": "error", "id": rid, "code": "connection_closed", "message": reason})
            self._status.put_nowait(None)  # and a status() waiting for its answer

    async def send(self, message: Mapping[str, Any]) -> None:
        """Send one raw protocol message (for tests and tools); prefer generate/chat/cancel."""
        await self.ws.send(wire.encode(message, self.binary))

    def generate(self, prompt: str | Sequence[int], request_id: str | None = None,
                 **params: Any) -> AsyncIterator[dict[str, Any]]:
        """Stream a completion of a text prompt (str) or of prompt token ids."""
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        value = prompt if isinstance(prompt, str) else list(prompt)
        return self._stream({"type": "generate", key: value, "params": params}, request_id)

    def chat(self, messages: Sequence[Mapping[str, str]], request_id: str | None = None,
             **params: Any) -> AsyncIterator[dict[str, Any]]:
        """Stream the assistant's answer to OpenAI-style messages ({"role", "content"})."""
        return self._stream({"type": "chat", "messages": [dict(m) for m in messages], "params": params},
                            request_id)

    async def _stream(self, message: dict[str, Any], request_id: str | None) -> AsyncIterator[dict[str, Any]]:
        rid = request_id or f"r{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already streaming on this client")
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._streams[rid] = queue
        ended = False
        try:
            await self.send({**message, "id": rid})
            while not ended:
                event = await queue.get()
                ended = event["type"] in TERMINAL
                yield event
        finally:
            self._streams.pop(rid, None)
            if not ended:
                self._abandoned.add(rid)
                with contextlib.suppress(ConnectionClosed):
                    await asyncio.shield(self.cancel(rid))

    async def cancel(self, request_id: str) -> None:
        await self.send({"type": "cancel", "id": request_id})

    async def status(self, request_id: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
        await self.send({"type": "status", "id": request_id})
        status = await asyncio.wait_for(self._status.get(), timeout_s)
        if status is None:  # the connection closed before the answer came
            await self.ws.wait_closed()
            self._status.put_nowait(None)  # for the next caller too
            raise self.ws.protocol.close_exc
        return status

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class connect:  # noqa: N801 - used like a function: `await connect(...)` or `async with connect(...)`
    """Open a connection and say hello; raises ServerError if the server refuses it."""

    def __init__(self, url: str, token: str | None, binary: bool = False,
                 client_name: str = "edgeinfer-python", open_timeout_s: float = 10.0,
                 **ws_options: Any) -> None:
        self._args = (url, token, binary, client_name, open_timeout_s, ws_options)
        self._client: Client | None = None

    async def _open(self) -> Client:
        url, token, binary, client_name, open_timeout_s, ws_options = self._args
        ws_options = {"compression": None, "max_size": None, **ws_options}
        ws = await ws_connect(url, open_timeout=open_timeout_s, **ws_options)
        client = Client(ws, binary)
        try:
            await client._hello(token, client_name)
        except (ServerError, ConnectionClosed):
            await ws.close()
            raise
        return client

    def __await__(self) -> Any:
        return self._open().__await__()

    async def __aenter__(self) -> Client:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        assert self._client is not None
        await self._client.close()
