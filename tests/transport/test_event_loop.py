"""The commands' event loop (edgeinfer.cli.event_loop): uvloop where it is installed, for both
ways a command starts one, and the engine's compute-thread hand-off working on it."""

import asyncio
import concurrent.futures

import anyio
import pytest

from edgeinfer.cli.event_loop import has_uvloop, run_async, run_coroutine
from edgeinfer.engine.model_actor import run_on


def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(not has_uvloop(), reason="uvloop is not installed here")
def test_commands_run_on_uvloop_and_the_compute_thread_hands_back():
    async def on_coroutine() -> tuple[str, int]:
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            return _loop_module(), await run_on(thread, lambda x: x * 2, 21)

    async def on_anyio(delay: float) -> str:
        await anyio.sleep(delay)
        return _loop_module()

    module, answer = run_coroutine(on_coroutine())
    assert module.startswith("uvloop") and answer == 42
    assert run_async(on_anyio, 0.001).startswith("uvloop")


def test_without_uvloop_asyncio_runs_the_same_code(monkeypatch):
    monkeypatch.setattr("edgeinfer.cli.event_loop.has_uvloop", lambda: False)

    async def which() -> str:
        return _loop_module()

    assert run_coroutine(which()).startswith("asyncio")
    assert run_async(which).startswith("asyncio")
