"""The serving benchmark's HTTP client: keep-alive HTTP/1.1 connections that POST a JSON body and
read its server-sent events back as lines.

Written by hand because the client runs on the same cores as the server it measures: through
httpx (over httpcore and h11) 16 prebuilt requests went out ~0.4 ms apart, and at one stream the
first token was read 3.6-8 ms after the server had written it (0.2-0.5 ms here), time that
showed up as the server's TTFT (docs/BENCHMARKS.md, 2026-11-27). Here a request is one write of prebuilt bytes (a
round writes all of its streams' requests at once, as the engine target submits them), and the
response is read through asyncio's buffered reader: the status line, the headers, then the
body by Content-Length or chunked transfer coding (what uvicorn and llama.cpp's server send).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


class HttpError(RuntimeError):
    pass


class Connection:
    """One HTTP/1.1 connection, reused request after request (one at a time)."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", **headers}.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()

    def request_bytes(self, method: str, path: str, body: Any = None) -> bytes:
        """A request ready to send: build it before a timed section, send it inside."""
        payload = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\n{self._headers}Content-Type: application/json\r\n" \
               f"Content-Length: {len(payload)}\r\n\r\n"
        return head.encode() + payload

    async def get_json(self, path: str) -> Any:
        self.write(self.request_bytes("GET", path))
        return json.loads(b"".join([chunk async for chunk in self.body()]))

    def write(self, request: bytes) -> None:
        """Send ``request`` (the socket takes it at once: a request is a few kB); read its answer
        with ``body`` or ``events``. Rounds write every stream's request before reading any."""
        assert self._writer is not None, "open() first"
        self._writer.write(request)

    async def body(self) -> AsyncIterator[bytes]:
        """The answer to the request written last, as it arrives (HttpError on a status other
        than 200, with the start of the body)."""
        assert self._reader is not None, "open() first"
        status_line = await self._reader.readuntil(b"\r\n")
        status = int(status_line.split(b" ", 2)[1])
        headers: dict[str, str] = {}
        while (line := await self._reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = self._chunked() if headers.get("transfer-encoding", "").lower() == "chunked" \
            else self._sized(int(headers.get("content-length", "0")))
        if status != 200:
            raise HttpError(f"{status}: {b''.join([c async for c in body])[:300]!r}")
        async for chunk in body:
            yield chunk

    async def _sized(self, length: int) -> AsyncIterator[bytes]:
        assert self._reader is not None
        if length:
            yield await self._reader.readexactly(length)

    async def _chunked(self) -> AsyncIterator[bytes]:
        assert self._reader is not None
        while True:
            size = int((await self._reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await self._reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the end
                    pass
                return
            chunk = await self._reader.readexactly(size + 2)
            yield chunk[:-2]

    async def events(self) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of the answer's body, one by one (b"[DONE]" included)."""
        pending = b""
        async for chunk in self.body():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: "):
                    yield line[6:].rstrip(b"\r")
