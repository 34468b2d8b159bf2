"""`edgeinfer chat`: a terminal chat that streams tokens, over the daemon when it runs, else in process.

A backend turns a conversation into a stream of wire events (docs/PROTOCOL.md, as dicts) so the
REPL reads one shape either way: `RemoteChat` over a websocket client, `LocalChat` over an Engine
started in this process. `open_chat_backend` makes the choice. The REPL owns the conversation;
Ctrl-C during an answer stops that answer (what streamed is kept), /reset starts over, Ctrl-D or
/exit quits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from edgeinfer.config import RuntimeConfig, SchedulerConfig
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import InvalidParams, SamplingParams, given_fields
from transport import auth, daemon
from transport import protocol as wire
from transport.client import Client, connect

Event = dict[str, Any]  # a wire event (docs/PROTOCOL.md)


class ChatBackend(Protocol):
    description: str

    def stream(self, messages: list[dict[str, str]], params: dict[str, Any]) -> AsyncIterator[Event]: ...


class RemoteChat:
    def __init__(self, client: Client, description: str) -> None:
        self.client = client
        self.description = description

    def stream(self, messages: list[dict[str, str]], params: dict[str, Any]) -> AsyncIterator[Event]:
        return self.client.chat(messages, **params)


class LocalChat:
    def __init__(self, engine: Any, description: str) -> None:
        self.engine = engine
        self.description = description
        self._ids = itertools.count(1)

    async def stream(self, messages: list[dict[str, str]], params: dict[str, Any]) -> AsyncIterator[Event]:
        rid = f"chat-{next(self._ids)}"
        try:
            sampling = SamplingParams.from_dict(params)
        except InvalidParams as exc:
            yield wire.error_to_wire("invalid_params", str(exc), rid)
            return
        request = GenerateRequest(rid, messages=tuple(dict(m) for m in messages), params=sampling,
                                  params_given=given_fields(params))
        async with contextlib.aclosing(self.engine.generate(request)) as events:
            async for event in events:
                yield wire.event_to_wire(event, rid)


@contextlib.asynccontextmanager
async def open_chat_backend(model_path: str | None, runtime: RuntimeConfig,
                            use_daemon: bool = True) -> AsyncIterator[ChatBackend]:
    """The running daemon's server if there is one (and use_daemon), else an engine in process."""
    state = daemon.running() if use_daemon else None
    if state is not None:
        async with connect(state.url, auth.load_or_create_token(), client_name="edgeinfer-chat") as client:
            yield RemoteChat(client, f"daemon pid {state.pid} at {state.url} ({state.model})")
        return
    from transport.service import open_engine  # imports torch only on this path

    # One turn at a time, as `generate`: no burst of requests to wait for (SchedulerConfig.burst_window_s).
    async with open_engine(model_path, runtime, SchedulerConfig(burst_window_s=0.0)) as (engine, name):
        yield LocalChat(engine, f"{name}, in process (no daemon running)")


async def read_lines() -> AsyncIterator[str | None]:
    """stdin lines without blocking the loop; a daemon thread, so exiting never waits on input()."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    wanted = threading.Event()  # prompt only when the REPL asks, not while an answer streams

    def reader() -> None:
        while True:
            wanted.wait()
            wanted.clear()
            try:
                line: str | None = input("\n> ")
            except (EOFError, KeyboardInterrupt):
                line = None
            loop.call_soon_threadsafe(queue.put_nowait, line)
            if line is None:
                return

    threading.Thread(target=reader, daemon=True, name="chat-input").start()
    while True:
        wanted.set()
        yield await queue.get()


async def chat_repl(backend: ChatBackend, params: dict[str, Any], lines: AsyncIterator[str | None],
                    write: Callable[[str], Any] = sys.stdout.write,
                    on_answer: Callable[[asyncio.Task[str] | None], None] | None = None) -> int:
    """Read user turns from `lines`, stream answers to `write`; returns 0 at end of input.

    `on_answer` is told the task streaming each answer (and None when it ends), so a Ctrl-C
    handler can cancel just that answer; the text streamed so far stays in the conversation.
    """
    conversation: list[dict[str, str]] = []
    write(f"edgeinfer chat: {backend.description}. /reset starts over, Ctrl-C stops an answer, "
          "Ctrl-D quits.\n")
    async for line in lines:
        if line is None or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            conversation.clear()
            write("(conversation cleared)\n")
            continue
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line})
        chunks: list[str] = []
        task = asyncio.ensure_future(_answer(backend, list(conversation), params, write, chunks))
        if on_answer is not None:
            on_answer(task)
        try:
            await asyncio.wait([task])  # not `await task`: its cancellation must not cancel us
        finally:
            if on_answer is not None:
                on_answer(None)
        if task.cancelled():
            write(" [stopped]\n")
        else:
            task.result()  # a failure of the backend itself propagates
        if chunks:
            conversation.append({"role": "assistant", "content": "".join(chunks)})
        else:
            conversation.pop()  # nothing came back: drop the unanswered turn
    return 0


async def _answer(backend: ChatBackend, conversation: list[dict[str, str]], params: dict[str, Any],
                  write: Callable[[str], Any], chunks: list[str]) -> str:
    num_tokens, sent, first = 0, time.monotonic(), None
    async with contextlib.aclosing(backend.stream(conversation, params)) as events:
        async for event in events:
            if event["type"] == "token":
                first = first or time.monotonic()
                num_tokens += len(event["token_ids"])
                chunks.append(event["text"])
                write(event["text"])
                if write is sys.stdout.write:
                    sys.stdout.flush()
            elif event["type"] == "error":
                write(f"\n[error {event['code']}: {event['message']}]\n")
    if first is not None:
        rate = (num_tokens - 1) / (time.monotonic() - first) if num_tokens > 1 else 0.0
        write(f"\n[TTFT {1000 * (first - sent):.0f} ms, {rate:.1f} tok/s, {num_tokens} tokens]\n")
    return "".join(chunks)
