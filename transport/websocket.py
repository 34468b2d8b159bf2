"""The websocket a `Connection` talks to, whatever library is underneath: `WebSocketPeer`, and
`AsgiWebSocket`, the peer over an ASGI websocket (Starlette's, served by uvicorn).

A connection needs five things of its socket: receive a frame, send a frame, close with a code and
a reason, know whether it is closed, and one exception for "the peer is gone" (`PeerClosed`), so
transport.connection never imports a websocket library.
"""

from __future__ import annotations

from typing import Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect


class PeerClosed(Exception):
    """The websocket is closed (by the client, the network or us): nothing more can be sent or read."""


class WebSocketPeer(Protocol):
    close_code: int | None  # None while open

    async def recv(self) -> str | bytes: ...

    async def send(self, frame: str | bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


class AsgiWebSocket:
    """A WebSocketPeer over an accepted ASGI websocket. uvicorn lets one task receive while others
    send, which the connection relies on (its reader and its writer are separate tasks)."""

    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket
        self.close_code: int | None = None

    async def recv(self) -> str | bytes:
        if self.close_code is not None:
            raise PeerClosed
        try:
            message = await self._ws.receive()
        except (OSError, RuntimeError) as exc:  # RuntimeError: receive after the disconnect was seen
            self.close_code = self.close_code or 1006
            raise PeerClosed from exc
        if message["type"] == "websocket.disconnect":
            self.close_code = message.get("code", 1005)
            raise PeerClosed
        text = message.get("text")
        return text if text is not None else message.get("bytes") or b""

    async def send(self, frame: str | bytes) -> None:
        if self.close_code is not None:
            raise PeerClosed
        message = {"type": "websocket.send", "bytes": frame} if isinstance(frame, bytes) else \
            {"type": "websocket.send", "text": frame}
        try:
            await self._ws.send(message)
        except (OSError, RuntimeError, WebSocketDisconnect) as exc:  # uvicorn's ClientDisconnected is an OSError
            self.close_code = self.close_code or 1006
            raise PeerClosed from exc

    async def close(self, code: int, reason: str) -> None:
        if self.close_code is not None:
            return
        self.close_code = code
        try:
            await self._ws.send({"type": "websocket.close", "code": code, "reason": reason})
        except (OSError, RuntimeError, WebSocketDisconnect):
            pass  # already gone: closed either way
