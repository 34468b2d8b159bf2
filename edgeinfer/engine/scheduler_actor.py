"""SchedulerActor: the anyio task around the Scheduler; routes events to per-request streams.

Writers: this actor's task is the one caller of its Scheduler (hence the one writer of request
state and block tables), the one sender on every request's event stream, and the one writer of
the `stats` snapshot that the Engine reads. Its inbox carries Submit messages from
`Engine.generate`; the model actor is reached only through `ask(StepPlan)`.

The loop: wait for a submission while idle; take every queued submission; drop each request
whose client closed its receive stream (freeing its blocks before the next step is planned);
then `plan = scheduler.schedule(); result = await model.ask(plan); events =
scheduler.postprocess(plan, result)` and send the events. A failed model step (ActorFailed: the
engine's supervisor is restarting the model actor) fails the requests that step carried and the
loop goes on; the next ask waits in the model's mailbox until the actor is back. A submission
that raises fails that request alone. Event streams are sized to hold every event of a request
(plus one slot held back for a slow_reader error, should a reader fall that far behind), so
sending never waits on a slow client. However the loop ends (inbox closed, a bug here,
cancellation) every open request is answered with an Error event and its stream closed:
engine_closed for an orderly shutdown, internal_error otherwise.

This actor is where the engine keeps a request's event order: one Accepted (or an Error) first,
and at most one final event, after which its stream is closed and forgotten.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from edgeinfer.core.events import ENGINE_CLOSED, INTERNAL, SLOW_READER, Error, Event, Finished, RequestError, Token
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.core.scheduler import Scheduler
from edgeinfer.engine.actor import ActorFailed, ActorRef, Envelope

log = logging.getLogger(__name__)

BURST_MAX_WINDOWS = 20  # a burst of submissions (_let_a_burst_in) is cut off after this many windows
# A window that took this much longer than asked found the event loop (or the process) busy:
# likely parsing the rest of the burst, so one more window follows it.
BURST_OVERRUN_S = 0.002
THROUGHPUT_WINDOW_S = 10.0  # tokens/s in stats is measured over the steps of this last window


@dataclass(frozen=True)
class Submit:
    """A new request (in-process only: it carries the request's event stream)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    events: MemoryObjectSendStream[Event]


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0  # free but holding a reusable prefix
    kv_bytes_used: int = 0
    prefix_cache_hit_rate: float = 0.0
    tokens_per_s: float = 0.0  # generated tokens, over the last THROUGHPUT_WINDOW_S
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0


class SchedulerActor:
    def __init__(self, scheduler: Scheduler, model: ActorRef[object]) -> None:
        if scheduler.config.burst_window_s is None:
            raise ValueError("SchedulerConfig.burst_window_s is None: settle it for the device first "
                             "(SchedulerConfig.for_device)")
        self._burst_window_s: float = scheduler.config.burst_window_s
        self.scheduler = scheduler
        self._model = model
        self._streams: dict[str, MemoryObjectSendStream[Event]] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) per step
        self._recent_tokens = 0  # sum of the tokens in _recent
        self._num_steps = 0
        self.stats = EngineStats()
        self._publish_stats()

    async def run(self, inbox: MemoryObjectReceiveStream[Envelope[Submit]], *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        code = INTERNAL  # unless the inbox closes: anything else ending this loop is a failure
        try:
            async with inbox:
                while True:
                    if not self.scheduler.has_work:
                        try:
                            self._submit((await inbox.receive()).message)
                        except anyio.EndOfStream:
                            code = ENGINE_CLOSED
                            break
                        await _let_a_burst_in(inbox, self._burst_window_s)
                    if not self._take_submissions(inbox):
                        code = ENGINE_CLOSED
                        break
                    self._drop_closed_streams()
                    if self.scheduler.has_work:
                        await self._step()
        finally:
            self._answer_all(code, inbox)
            self._model.close()

    async def _step(self) -> None:
        plan = self.scheduler.schedule()
        # Cannot be empty: a waiting request is always admitted when nothing runs.
        assert plan.seqs, "the scheduler planned an empty step while it has work"
        try:
            result = await self._model.ask(plan)
        except ActorFailed as exc:
            cause = exc.__cause__ or exc
            why = f"the model step running this request failed ({type(cause).__name__}: {cause})"
            events = self.scheduler.fail_step(plan, why[:500])
        else:
            events = self.scheduler.postprocess(plan, result)
        for event in events:
            self._send(event)
        self._num_steps += 1
        # Tokens, not steps: a step emits several for n > 1 forks and accepted drafts.
        self._publish_stats(sum(len(e.token_ids) for e in events if isinstance(e, Token)))

    def _submit(self, msg: Submit) -> None:
        try:
            accepted = self.scheduler.add_request(msg.request_id, msg.prompt_ids, msg.params)
        except RequestError as exc:
            _send_final(msg.events, Error(msg.request_id, exc.code, exc.message, exc.retry_after_s))
            return
        except Exception as exc:  # a bug this request reached: it alone fails
            log.exception("request %s: admission failed", msg.request_id)
            self.scheduler.abort(msg.request_id)
            _send_final(msg.events, Error(msg.request_id, INTERNAL, f"{type(exc).__name__}: {exc}"[:500]))
            return
        self._streams[msg.request_id] = msg.events
        self._send(accepted)

    def _take_submissions(self, inbox: MemoryObjectReceiveStream[Envelope[Submit]]) -> bool:
        """Handle every queued submission; False once the inbox is closed and empty."""
        while True:
            try:
                self._submit(inbox.receive_nowait().message)
            except anyio.WouldBlock:
                return True
            except anyio.EndOfStream:
                return False

    def _drop_closed_streams(self) -> None:
        for request_id, stream in list(self._streams.items()):
            if stream.statistics().open_receive_streams == 0:
                self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._streams.pop(request_id).close()
        self._publish_stats()

    def _send(self, event: Event) -> None:
        stream = self._streams.get(event.request_id)
        if stream is None:
            return  # already ended (a request's first final event is its only one)
        final = isinstance(event, (Finished, Error))
        buffer = stream.statistics()
        if not final and buffer.current_buffer_used >= buffer.max_buffer_size - 1:
            # Sized to hold every event, so the reader must have stopped reading: end the request
            # with the slot held back for this, never by waiting on it.
            log.warning("request %s: %d events unread, cancelling it", event.request_id, buffer.current_buffer_used)
            event, final = Error(event.request_id, SLOW_READER, f"{buffer.current_buffer_used} events were "
                                 "not read; the request was cancelled"), True
            self.scheduler.abort(event.request_id)
        try:
            stream.send_nowait(event)
        except anyio.BrokenResourceError:  # the client went away
            self._drop(event.request_id)
            return
        if final:
            self._streams.pop(event.request_id).close()

    def _answer_all(self, code: str, inbox: MemoryObjectReceiveStream[Envelope[Submit]]) -> None:
        message = "the engine is shutting down" if code == ENGINE_CLOSED else "the engine failed"
        while True:  # submissions still queued get the same answer
            try:
                msg = inbox.receive_nowait().message
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            _send_final(msg.events, Error(msg.request_id, code, message))
        for request_id, stream in list(self._streams.items()):
            _send_final(stream, Error(request_id, code, message))
        try:  # free the blocks too, unless the scheduler's own failure brought us here
            for request_id in self._streams:
                self.scheduler.abort(request_id)
            self._publish_stats()
        except Exception:
            log.exception("could not release the requests' blocks at shutdown")
        self._streams.clear()

    def _publish_stats(self, num_new_tokens: int = 0) -> None:
        now = time.monotonic()
        self._recent.append((now, num_new_tokens))
        self._recent_tokens += num_new_tokens  # a running sum: the window holds ~1,400 steps at 7 ms
        while now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
            self._recent_tokens -= self._recent.popleft()[1]
        span = now - self._recent[0][0]
        s = self.scheduler.stats()
        bytes_per_block = self.scheduler.block_size * self.scheduler.bytes_per_token
        self.stats = EngineStats(
            s.num_running, s.num_waiting, s.num_blocks, s.num_blocks_used, s.num_blocks_free,
            s.num_blocks_cached, s.num_blocks_used * bytes_per_block,
            s.prefix_hit_rate, self._recent_tokens / span if span > 0 else 0.0,
            s.num_generated_tokens, s.num_preemptions, self._num_steps)


async def _let_a_burst_in(inbox: MemoryObjectReceiveStream[Envelope[Submit]], window_s: float) -> None:
    """After an idle engine's first submission, wait in windows of ``window_s`` while more keep
    arriving (SchedulerConfig.burst_window_s). Requests sent together (a client's parallel calls,
    the streams of a page) reach the server within a few milliseconds, but each is submitted only
    once the server has parsed it (~0.3 ms each on the 2-core machine): planned at the first, the
    step ran that prompt alone and the rest waited out the whole step (~50 ms more TTFT for 15 of
    16 streams, docs/BENCHMARKS.md). They also arrive spread out: traced, a local client's 16
    requests, written together, came in over ~2 ms, since the server, woken by the first, took the
    client's core while it wrote the rest (hence the CPU's 2 ms windows). A window that overran by
    BURST_OVERRUN_S found the loop busy, so one more window follows it even without news: traced,
    the 15 other handlers of a 16-request burst ran inside the first window, which ended ~9 ms
    late, before any of them had submitted. Only one: on a starved machine every window overruns,
    and a lone request would wait out all of them."""
    if not window_s:
        return
    grace = True  # one overrun window without news may be followed by another
    for _ in range(BURST_MAX_WINDOWS):
        queued = inbox.statistics().current_buffer_used
        start = anyio.current_time()
        await anyio.sleep(window_s)
        if inbox.statistics().current_buffer_used != queued:
            grace = True
        elif grace and anyio.current_time() - start > window_s + BURST_OVERRUN_S:
            grace = False
        else:
            return


def _send_final(stream: MemoryObjectSendStream[Event], event: Event) -> None:
    with stream:
        try:
            stream.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
            pass  # the client is gone or not reading: nobody to tell
