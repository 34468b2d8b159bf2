"""The websocket server's settings (ServerConfig, validated at construction), its close codes, and
what it needs of an engine (EngineLike)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from edgeinfer.core.events import Event, Health

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
    # Keys the OpenAI API (/v1/*) takes as `Authorization: Bearer` besides the token (--api-key).
    api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ValueError("ServerConfig.token must be at least 16 characters (see transport.auth)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port}")
        for name in ("max_frame_bytes", "max_connections", "max_requests_per_connection",
                     "send_queue_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if any(len(key) < 8 or key != key.strip() for key in self.api_keys):
            raise ValueError("--api-key must be at least 8 characters, without surrounding spaces")
        if self.hello_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("ServerConfig.hello_timeout_s must be > 0 and drain_timeout_s >= 0")


class EngineLike(Protocol):
    """What the server needs of edgeinfer.engine.api.Engine (and the tests' EchoEngine, tests/echo_engine.py)."""

    def generate(self, request: Any) -> AsyncIterator[Event]: ...

    def stats(self) -> Any: ...

    def health(self) -> Health: ...
