"""`edgeinfer daemon` end to end with the default model: start/status/stop, a second start refused,
a stale state file recovered, SIGTERM draining an in-flight request; and the chat REPL over it."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgeinfer.config import RuntimeConfig
from transport import auth, daemon
from transport.chat import LocalChat, RemoteChat, chat_repl, open_chat_backend
from transport.client import connect

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dirs(tmp_path, monkeypatch, default_model_path):
    env = {**os.environ, daemon.STATE_ENV: str(tmp_path / "state"), auth.CONFIG_ENV: str(tmp_path / "config"),
           "PYTHONPATH": str(ROOT), "MODEL": str(default_model_path)}
    monkeypatch.setenv(daemon.STATE_ENV, env[daemon.STATE_ENV])
    monkeypatch.setenv(auth.CONFIG_ENV, env[auth.CONFIG_ENV])
    yield env
    subprocess.run([sys.executable, "-m", "edgeinfer.cli", "daemon", "stop", "--timeout", "5"], env=env,
                   capture_output=True, timeout=30)


def start_args(env):
    # A small fixed pool: the test needs a handful of sequences, not a quarter of the RAM.
    return ("start", "--model", env["MODEL"], "--port", "0", "--kv-memory", "64MB")


def cli(env, *args, timeout=120):
    cmd = [sys.executable, "-m", "edgeinfer.cli", "daemon", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_start_status_stop_cycle(dirs, tmp_path):
    started = cli(dirs, *start_args(dirs))
    assert started.returncode == 0, started.stderr
    state = daemon.running()
    assert state is not None and f"pid {state.pid}" in started.stdout and state.model == Path(dirs["MODEL"]).name
    assert daemon.healthy(state)
    token_file = tmp_path / "config" / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600

    status = cli(dirs, "status")
    assert status.returncode == 0 and "running" in status.stdout
    assert f"#token={token_file.read_text().strip()}" in status.stdout

    second = cli(dirs, *start_args(dirs))
    assert second.returncode == 1 and "already running" in second.stderr and str(state.pid) in second.stderr

    stopped = cli(dirs, "stop")
    assert stopped.returncode == 0 and f"stopped (pid {state.pid})" in stopped.stdout
    assert daemon.running() is None and not (tmp_path / "state" / daemon.STATE_FILE).exists()
    assert cli(dirs, "status").returncode == 3
    logs = cli(dirs, "logs")
    assert f"serving {state.model}" in logs.stdout and "stopped" in logs.stdout
    pool_mb = int(re.search(r"memory plan: weights [0-9,]+ MB, KV cache fp16 ([0-9,]+) MB", logs.stdout).group(1))
    assert 58 <= pool_mb <= 64  # --kv-memory 64MB sized it


def test_stale_state_file_is_recovered(dirs, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs, as after kill -9 or a crash
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / daemon.STATE_FILE).write_text(json.dumps({"pid": dead.pid, "host": "127.0.0.1", "port": 1}))
    assert cli(dirs, "status").returncode == 3  # the lock is free: not running
    (state_dir / daemon.STATE_FILE).write_text(json.dumps({"pid": dead.pid, "host": "127.0.0.1", "port": 1}))
    started = cli(dirs, *start_args(dirs))
    assert started.returncode == 0, started.stderr
    assert "stale" in started.stderr
    assert daemon.running().pid != dead.pid


def test_sigterm_drains_in_flight_requests(dirs):
    assert cli(dirs, *start_args(dirs)).returncode == 0
    state = daemon.running()

    async def main():
        async with connect(state.url, auth.load_or_create_token()) as client:
            stream = client.generate("Once upon a time", max_tokens=200, ignore_eos=True)
            assert (await anext(stream))["type"] == "accepted"
            assert (await anext(stream))["type"] == "token"  # running when the stop arrives
            stopping = asyncio.create_task(asyncio.to_thread(cli, dirs, "stop"))
            events = [event async for event in stream]
            assert events[-1]["type"] == "done" and events[-1]["finish_reason"] == "length"
            assert events[-1]["usage"]["completion_tokens"] == 200
            assert (await stopping).returncode == 0

    asyncio.run(asyncio.wait_for(main(), 30))
    assert daemon.running() is None


def test_chat_repl_uses_the_daemon(dirs):
    assert cli(dirs, *start_args(dirs)).returncode == 0

    async def lines():
        for line in ("hello there", "/reset", "again please", None):
            yield line

    async def main():
        out: list[str] = []
        async with open_chat_backend(None, None) as backend:
            assert isinstance(backend, RemoteChat) and "daemon" in backend.description
            assert await chat_repl(backend, {"max_tokens": 4}, lines(), out.append) == 0
        text = "".join(out)
        assert "(conversation cleared)" in text and text.count("tok/s") == 2  # two answers, each timed

    asyncio.run(asyncio.wait_for(main(), 30))


def test_chat_in_process_answers_without_a_burst_window(default_model_path):
    """Without a daemon the chat runs an engine in process, one turn at a time: it plans each
    turn at once (burst window 0) instead of waiting for requests that cannot come."""
    async def lines():
        for line in ("hello there", None):
            yield line

    async def main():
        out: list[str] = []
        async with open_chat_backend(str(default_model_path), RuntimeConfig(), use_daemon=False) as backend:
            assert isinstance(backend, LocalChat) and "in process" in backend.description
            assert backend.engine.config.scheduler.burst_window_s == 0.0
            assert await chat_repl(backend, {"max_tokens": 4}, lines(), out.append) == 0
        assert "".join(out).count("tok/s") == 1

    asyncio.run(asyncio.wait_for(main(), 60))


def test_chat_repl_stop_keeps_the_partial_answer():
    class SlowBackend:
        description = "fake"

        def __init__(self):
            self.seen = []

        async def stream(self, messages, params):
            self.seen.append(list(messages))
            for i in range(1000):
                await asyncio.sleep(0.01)
                yield {"type": "token", "id": "x", "text": f"t{i} ", "token_ids": [i]}

    async def main():
        backend = SlowBackend()
        queue: asyncio.Queue = asyncio.Queue()

        async def lines():
            while True:
                yield await queue.get()

        def on_answer(task):
            if task is not None:
                asyncio.get_running_loop().call_later(0.1, task.cancel)  # Ctrl-C after a few tokens

        out: list[str] = []
        repl = asyncio.create_task(chat_repl(backend, {}, lines(), out.append, on_answer))
        await queue.put("first")
        await asyncio.sleep(0.3)
        await queue.put("second")
        await asyncio.sleep(0.3)
        await queue.put(None)
        assert await repl == 0
        assert out.count(" [stopped]\n") == 2
        first_answer = backend.seen[1][1]
        assert first_answer["role"] == "assistant" and first_answer["content"].startswith("t0 t1 ")

    asyncio.run(asyncio.wait_for(main(), 10))


def test_state_follows_the_config_dir(tmp_path, monkeypatch) -> None:
    """EDGEINFER_CONFIG_DIR alone moves the daemon's state too; EDGEINFER_STATE_DIR still wins."""
    monkeypatch.delenv(daemon.STATE_ENV, raising=False)
    monkeypatch.setenv(auth.CONFIG_ENV, str(tmp_path / "config"))
    assert daemon.state_dir() == tmp_path / "config" / "state"
    monkeypatch.setenv(daemon.STATE_ENV, str(tmp_path / "elsewhere"))
    assert daemon.state_dir() == tmp_path / "elsewhere"
