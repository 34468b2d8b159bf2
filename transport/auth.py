"""Who may talk to the server: the access token file, and the Host/Origin checks for browsers.

The token is created on first start as a 0600 file in the user's config dir, so only that user
(and what runs as them) can read it. Browsers are the other threat: any web page can open a
websocket to 127.0.0.1, so a browser connection must come from the server's own page (Origin),
and every HTTP request must name the server by a loopback or bound host (Host), which stops DNS
rebinding (evil.example resolving to 127.0.0.1 would otherwise be "same origin").
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

CONFIG_ENV = "EDGEINFER_CONFIG_DIR"
TOKEN_FILE = "token"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


class TokenFileError(RuntimeError):
    """The token file exists but cannot be trusted or read."""


def config_dir() -> Path:
    """$EDGEINFER_CONFIG_DIR, else $XDG_CONFIG_HOME/edgeinfer, else ~/.config/edgeinfer."""
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "edgeinfer"


def token_path(directory: Path | None = None) -> Path:
    return (directory or config_dir()) / TOKEN_FILE


def load_or_create_token(path: Path | None = None) -> str:
    """Read the token, creating it (0600, atomically, never overwriting a racing writer) if absent."""
    path = path or token_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = secrets.token_urlsafe(32)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (token + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process created it first; theirs wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise TokenFileError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
    token = path.read_text().strip()
    if len(token) < 16:
        raise TokenFileError(f"{path} holds no usable token (under 16 characters); delete it for a new one")
    return token


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so the token cannot be guessed byte by byte from timings."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def allowed_hosts(bound_host: str, port: int) -> frozenset[str]:
    """Host header values that name this server: loopback names and the bound address, with port."""
    names = set(LOOPBACK_HOSTS)
    if bound_host not in ("0.0.0.0", "::", ""):
        names.add(f"[{bound_host}]" if ":" in bound_host else bound_host)
    return frozenset(f"{name}:{port}" for name in names)


def host_allowed(host_header: str | None, hosts: frozenset[str]) -> bool:
    return host_header is not None and host_header.lower() in hosts


def origin_allowed(origin: str | None, host_header: str | None, hosts: frozenset[str],
                   extra_origins: tuple[str, ...] = ()) -> bool:
    """No Origin: not a browser (the token still guards). Else it must be this server's own page,
    exactly `http://<Host>` (the server speaks no TLS, so an https origin is another site)."""
    if origin is None:
        return True
    if origin in extra_origins:
        return True
    host = (host_header or "").lower()
    return host in hosts and origin.lower() == f"http://{host}"
