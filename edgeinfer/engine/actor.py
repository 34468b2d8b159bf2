"""A minimal actor runtime on anyio: bounded mailboxes, tell/ask, and a supervising task group.

An actor is a coroutine that owns its state and reads envelopes from a bounded mailbox (a memory
object stream). `ActorRef` is the send side: `tell` posts a fire-and-forget message, `ask` posts
a message with a one-shot reply stream and waits for the answer. `serve` is the loop most actors
run: it calls a handler per message and replies; a handler that raises answers the pending ask
with the failure (the caller gets ActorFailed, never a hang) and then re-raises, so the
supervising task group cancels the other actors. The actor's own task is the one writer of its
state; the mailbox is the only way in.

Shutdown: closing every ActorRef (the send side) ends the actor's `async for`, after the messages
already queued are handled (drain); cancelling the task group cancels instead.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

log = logging.getLogger(__name__)

Msg = TypeVar("Msg")


class ActorFailed(RuntimeError):
    """The actor asked failed while handling the message, or stopped before replying."""


@dataclass(frozen=True)
class Envelope(Generic[Msg]):
    message: Msg
    reply_to: MemoryObjectSendStream[Any] | None = None  # None: fire-and-forget


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class ActorRef(Generic[Msg]):
    """The send side of an actor's mailbox."""

    def __init__(self, name: str, send: MemoryObjectSendStream[Envelope[Msg]]) -> None:
        self.name = name
        self._send = send

    async def tell(self, message: Msg) -> None:
        """Post a message without waiting for its handling (waits only while the mailbox is full).

        The message is in the mailbox when this returns or first yields: `send` would yield to
        the event loop before posting, so a burst of requests parsed in one loop pass reached the
        scheduler one pass late, after it had judged the burst over."""
        try:
            try:
                self._send.send_nowait(Envelope(message))
            except anyio.WouldBlock:
                await self._send.send(Envelope(message))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ActorFailed(f"actor {self.name} is not running") from None

    async def ask(self, message: Msg) -> Any:
        """Post a message and wait for the handler's return value; ActorFailed if it raised."""
        reply_send, reply_receive = anyio.create_memory_object_stream[Any](1)
        with reply_receive:
            try:
                await self._send.send(Envelope(message, reply_send))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                reply_send.close()
                raise ActorFailed(f"actor {self.name} is not running") from None
            try:
                reply = await reply_receive.receive()
            except anyio.EndOfStream:
                raise ActorFailed(f"actor {self.name} stopped before replying") from None
        if isinstance(reply, _Failure):
            raise ActorFailed(f"actor {self.name} failed: {reply.error!r}") from reply.error
        return reply

    def close(self) -> None:
        """Drop this sender; the actor ends once every sender is closed and its mailbox drained."""
        self._send.close()


def mailbox(name: str, size: int) -> tuple[ActorRef[Any], MemoryObjectReceiveStream[Envelope[Any]]]:
    """A bounded mailbox: the ref to hand to senders and the inbox the actor reads."""
    send, receive = anyio.create_memory_object_stream[Envelope[Any]](size)
    return ActorRef(name, send), receive


async def serve(
    name: str,
    inbox: MemoryObjectReceiveStream[Envelope[Any]],
    handle: Callable[[Any], Awaitable[Any]],
    *,
    restart: Callable[[Exception], Awaitable[bool]] | None = None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run an actor: handle each message in order, reply to asks. Start with `tg.start(...)`.

    A handler that raises answers its asker with the failure; then, with a `restart` policy
    (the supervisor's), the actor awaits `restart(exc)` and goes on serving if it returns True
    (messages sent meanwhile wait in the mailbox); without one, or on False, it re-raises."""
    task_status.started()
    async with inbox:
        try:
            async for envelope in inbox:
                try:
                    result = await handle(envelope.message)
                except Exception as exc:
                    log.error("actor %s failed handling %s", name, type(envelope.message).__name__,
                              exc_info=exc)
                    _reply(envelope, _Failure(exc))
                    if restart is not None and await restart(exc):
                        continue
                    raise
                except BaseException:  # cancelled: the asker gets EndOfStream, then we re-raise
                    _close(envelope)
                    raise
                _reply(envelope, result)
        finally:
            close_pending(inbox)


def close_pending(inbox: MemoryObjectReceiveStream[Envelope[Any]]) -> None:
    """Answer every ask still queued in a mailbox with EndOfStream, so no asker waits forever."""
    while True:
        try:
            _close(inbox.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return


def _reply(envelope: Envelope[Any], value: Any) -> None:
    if envelope.reply_to is None:
        return
    with envelope.reply_to:
        try:
            envelope.reply_to.send_nowait(value)  # buffer of 1, never full: no await needed
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the asker was cancelled and went away


def _close(envelope: Envelope[Any]) -> None:
    if envelope.reply_to is not None:
        envelope.reply_to.close()
