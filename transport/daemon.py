"""`edgeinfer daemon start|stop|status|logs`: the server in the background, one per user.

Files in the state dir ($EDGEINFER_STATE_DIR, else $XDG_STATE_HOME/edgeinfer, else
~/.local/state/edgeinfer): `daemon.lock`, which the server process holds (flock) for its whole
life, so "is one running?" is answered by the kernel and a crash leaves no lie behind;
`daemon.json` (pid, host, port, model), which the server process alone writes once it listens
and removes on a clean exit; `daemon.log`, its stdout and stderr. A daemon.json whose lock is
free is stale (a killed process) and is removed by the next start.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from transport import auth

STATE_ENV = "EDGEINFER_STATE_DIR"
LOCK_FILE, STATE_FILE, LOG_FILE = "daemon.lock", "daemon.json", "daemon.log"


class DaemonError(RuntimeError):
    """A daemon command cannot do what was asked; the message says why."""


@dataclass(frozen=True)
class DaemonState:
    pid: int
    host: str
    port: int
    model: str = ""
    started_at: float = field(default_factory=time.time)

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}/ws"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"


def state_dir() -> Path:
    """$EDGEINFER_STATE_DIR; else under $EDGEINFER_CONFIG_DIR when that is set (one folder holds a
    whole separate set-up: token and daemon); else $XDG_STATE_HOME/edgeinfer."""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]).expanduser()
    if os.environ.get(auth.CONFIG_ENV):
        return Path(os.environ[auth.CONFIG_ENV]).expanduser() / "state"
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "edgeinfer"


def acquire_lock(directory: Path) -> IO[str]:
    """Take the daemon lock for this process's life (the caller keeps the file open)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    handle = open(directory / LOCK_FILE, "a+")  # noqa: SIM115 - held open on purpose
    for _ in range(10):  # a `status` probing the lock holds it for a moment: retry briefly
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            time.sleep(0.05)
    handle.close()
    raise DaemonError(_already(read_state(directory)))


def lock_is_held(directory: Path) -> bool:
    path = directory / LOCK_FILE
    if not path.exists():
        return False
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def write_state(directory: Path, state: DaemonState) -> None:
    tmp = directory / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, directory / STATE_FILE)  # readers see the old file or the new one, never half


def read_state(directory: Path) -> DaemonState | None:
    try:
        return DaemonState(**json.loads((directory / STATE_FILE).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def clear_state(directory: Path) -> None:
    (directory / STATE_FILE).unlink(missing_ok=True)


def running(directory: Path | None = None) -> DaemonState | None:
    """The running daemon's state, or None (removing a stale state file on the way)."""
    directory = directory or state_dir()
    state = read_state(directory)
    if lock_is_held(directory):
        return state  # None while it is still starting (the state file comes once it listens)
    if state is not None:
        clear_state(directory)
    return None


def start(serve_args: list[str], directory: Path | None = None, timeout_s: float = 120.0) -> DaemonState:
    """Start `edgeinfer serve <serve_args>` in the background; return once it answers /healthz."""
    directory = directory or state_dir()
    if lock_is_held(directory):
        raise DaemonError(_already(read_state(directory)))
    stale = read_state(directory)
    if stale is not None:
        clear_state(directory)
        print(f"edgeinfer: removed a stale daemon state (pid {stale.pid} is gone)", file=sys.stderr)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path = directory / LOG_FILE
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    package_root = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    cmd = [sys.executable, "-m", "edgeinfer.cli", "serve", *serve_args, "--daemon-state", str(directory)]
    with os.fdopen(fd, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        log.flush()
        # A new session: the daemon outlives this shell and does not get its terminal's Ctrl-C.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd="/")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonError(f"the daemon exited with status {proc.returncode} while starting; "
                              f"last log lines:\n{tail(log_path, 15)}")
        state = read_state(directory)
        if state is not None and state.pid == proc.pid and healthy(state):
            return state
        time.sleep(0.1)
    proc.terminate()
    raise DaemonError(f"the daemon did not answer within {timeout_s:g} s; see {log_path}")


def _already(state: DaemonState | None) -> str:
    where = f" (pid {state.pid}, {state.url})" if state else " (still starting)"
    return f"a daemon is already running{where}; stop it with `edgeinfer daemon stop`"


def healthy(state: DaemonState, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{state.http}/healthz", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def stop(directory: Path | None = None, timeout_s: float = 40.0) -> DaemonState | None:
    """SIGTERM (the server drains), wait up to timeout_s, then SIGKILL. None if none was running."""
    directory = directory or state_dir()
    state = running(directory)
    if state is None:
        return None
    try:
        os.kill(state.pid, signal.SIGTERM)
    except ProcessLookupError:
        clear_state(directory)
        return state
    deadline = time.monotonic() + timeout_s
    while lock_is_held(directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    if lock_is_held(directory):
        os.kill(state.pid, signal.SIGKILL)
        while lock_is_held(directory):
            time.sleep(0.05)
        clear_state(directory)
    return state


def tail(path: Path, num_lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return b"\n".join(f.read().splitlines()[-num_lines:]).decode(errors="replace")
    except FileNotFoundError:
        return ""


def follow(path: Path, out: IO[str] = sys.stdout) -> None:
    """Print lines as they are appended, until interrupted (`logs -f`)."""
    with open(path, errors="replace") as f:
        f.seek(0, os.SEEK_END)
        while True:
            line = f.readline()
            if line:
                out.write(line)
                out.flush()
            else:
                time.sleep(0.2)
