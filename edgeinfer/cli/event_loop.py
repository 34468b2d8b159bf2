"""The event loop the commands run on: uvloop where it is installed (a dependency on Linux and
macOS), else asyncio's own.

Why: a lone OpenAI request's time to first token is ~1 ms shorter on it, mostly the scheduler's
0.5 ms burst window, a sleep asyncio's loop overslept by ~1 ms (docs/BENCHMARKS.md, "The HTTP
path: httptools and uvloop"); a decode step's hand-offs between the actors and the compute thread
measured the same on both loops. Windows has no uvloop; there, and wherever it is missing,
asyncio's loop runs the same code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(coro), on uvloop where installed."""
    if not has_uvloop():
        return asyncio.run(coro)
    import uvloop

    return uvloop.run(coro)


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """anyio.run(fn, *args) on asyncio, on uvloop where installed."""
    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": has_uvloop()})
