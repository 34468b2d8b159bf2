"""Engine: the async API over the actors. `async with Engine(config) as engine:` then
`async for event in engine.generate(request)`.

The engine owns the supervising task group: the model actor and the scheduler actor start under
it with `tg.start` and share nothing but messages. The engine is their supervisor:
- A failed model step fails the requests that step carried (internal_error; the scheduler frees
  their blocks), and the supervisor restarts the model actor (a fresh actor over the loaded
  weights, on the same compute thread) while `health()` says "restarting" for
  `restart_delay_s`; requests queue meanwhile and run once it is back. `max_failures` steps
  failing in a row (none succeeding between) mean the model cannot run: health "failed", and
  both actors stop.
- Any other actor failure (a bug in the scheduler) stops both: the scheduler actor answers every
  open request with internal_error on its way out, and the supervisor records the failure in
  `engine.error` and `health()` instead of cancelling the caller's task, so every client sees
  its Error event.
Failures confined to one request (its sampling, detokenizing, stop checks, beam scoring) never
reach the supervisor: the model actor and the scheduler fail that request alone. Leaving the
`async with` closes the scheduler's inbox: open requests get engine_closed and the actors end.

Each request's events flow through its own bounded stream, whose receive end the caller's
RequestStream holds; closing it (break, cancellation, `aclose`) is how a request is cancelled:
the scheduler actor sees the closed stream and frees the sequence's blocks before its next step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
from anyio.abc import TaskStatus

from edgeinfer.config import ModelConfig, RuntimeConfig, SchedulerConfig
from edgeinfer.core.events import ENGINE_CLOSED, INTERNAL, INVALID_PARAMS, Error, Event, Finished, Health
from edgeinfer.core.guides import GuideCompiler, GuideError
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import InvalidParams, with_model_defaults
from edgeinfer.core.scheduler import Scheduler
from edgeinfer.engine.actor import ActorFailed, mailbox, serve
from edgeinfer.engine.model_actor import ModelActor, Sampler, StepRunner, compute_thread, run_on
from edgeinfer.engine.scheduler_actor import EngineStats, SchedulerActor, Submit
from edgeinfer.models.host_memory import keep_step_buffers
from edgeinfer.models.loader import load_model
from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.worker.build import build_runners, resolve_device
from edgeinfer.worker.memory_plan import MemoryPlan
from edgeinfer.worker.model_runner import ModelRunner
from edgeinfer.worker.sampler import sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisionConfig:
    """How the engine outlives a failed model step (see the module docstring)."""

    restart_delay_s: float = 1.0  # health stays "restarting" (/healthz 503) this long after a failure
    max_failures: int = 3  # model steps failing in a row before the engine gives up

    def __post_init__(self) -> None:
        if not 0 <= self.restart_delay_s <= 600:
            raise ValueError(f"restart_delay_s must be in [0, 600] seconds, got {self.restart_delay_s}")
        if self.max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {self.max_failures}")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    draft_model_path: str | None = None  # the drafter when scheduler.speculative is "draft"

    def __post_init__(self) -> None:
        if (self.scheduler.speculative == "draft") != (self.draft_model_path is not None):
            raise ValueError("a draft model and speculative='draft' go together: give both or neither "
                             f"(speculative={self.scheduler.speculative!r}, draft model {self.draft_model_path!r})")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._runner: StepRunner | None = None
        self._draft_runner: ModelRunner | None = None
        self._tokenizer: Tokenizer | None = None
        self._model_config: ModelConfig | None = None
        self._scheduler_config = config.scheduler
        self._max_model_len: int | None = None  # from_runner's; else the runtime's context_length
        self._sampler: Sampler = sample
        self._guides: GuideCompiler | None = None  # the scheduler's; requests warm its cache first
        self._health = Health("starting")
        self._consecutive_failures = 0  # model steps failed since the last one that succeeded
        self.error: BaseException | None = None  # why the actors stopped, if they failed

    @classmethod
    def from_runner(cls, runner: StepRunner, tokenizer: Any, model_config: ModelConfig,
                    scheduler: SchedulerConfig | None = None, max_model_len: int | None = None,
                    supervision: SupervisionConfig | None = None, sampler: Sampler = sample,
                    draft: ModelRunner | None = None) -> Engine:
        """An engine over an already-built runner (a loaded model reused, or a fake in tests);
        `sampler` replaces edgeinfer.worker.sampler.sample (fault-injection tests); `draft` is a
        draft model's runner whose pool has the target pool's blocks (speculative "draft")."""
        scheduler = (scheduler or SchedulerConfig()).for_device(_device_type(runner))
        # A runner built elsewhere keeps the threads its builder chose (RuntimeConfig.share_cpu off).
        engine = cls(EngineConfig("<runner>", RuntimeConfig(share_cpu=False), scheduler=scheduler,
                                  supervision=supervision or SupervisionConfig(),
                                  draft_model_path=None if draft is None else "<runner>"))
        engine._runner, engine._tokenizer, engine._model_config = runner, tokenizer, model_config
        engine._draft_runner = draft
        engine._max_model_len = max_model_len
        engine._sampler = sampler
        return engine

    @property
    def tokenizer(self) -> Tokenizer:
        assert self._tokenizer is not None, "the engine is not started"
        return self._tokenizer

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """What the model holds (weights, KV pool, context); None for a runner built elsewhere."""
        return getattr(self._runner, "memory_plan", None)

    @property
    def linear_path(self) -> str | None:
        """The linear kernels the model runs (kernels.dispatch); None for a fake runner."""
        return getattr(getattr(self._runner, "model", None), "linear_path", None)

    def stats(self) -> EngineStats:
        return self._scheduler_actor.stats

    def health(self) -> Health:
        return self._health

    async def __aenter__(self) -> Engine:
        # Loads the model and runs every step (see compute_thread).
        self._compute = compute_thread(self.config.runtime.compute_nice)
        if self._runner is None:
            try:
                loaded = await run_on(self._compute, load_model, self.config.model_path)
                draft = self.config.draft_model_path
                loaded_draft = None if draft is None else await run_on(self._compute, load_model, draft)
                sc = self._scheduler_config = self._scheduler_config.for_device(
                    resolve_device(self.config.runtime).type)
                self._runner, self._draft_runner = await run_on(
                    self._compute, build_runners, loaded, self.config.runtime, sc.max_num_batched_tokens,
                    sc.max_num_seqs, loaded_draft)
                keep_step_buffers()
            except BaseException:
                self._compute.shutdown(wait=False)
                raise
            self._tokenizer, self._model_config = loaded.tokenizer, loaded.config
        c, pool, draft = self._model_config, self._runner.pool, self._draft_runner
        if draft is not None and (draft.pool.num_blocks, draft.pool.block_size) != (pool.num_blocks, pool.block_size):
            raise ValueError(f"the draft model's pool ({draft.pool.num_blocks} x {draft.pool.block_size}) must have "
                             f"the target pool's blocks ({pool.num_blocks} x {pool.block_size})")
        self._guides = _guide_compiler(self._tokenizer, c.vocab_size, c.eos_token_ids)
        scheduler = Scheduler(
            self._scheduler_config, num_blocks=pool.num_blocks, block_size=pool.block_size,
            max_model_len=self.config.runtime.context_length(c.max_position) if self._max_model_len is None
            else min(c.max_position, self._max_model_len),
            vocab_size=c.vocab_size, eos_token_ids=c.eos_token_ids,
            bytes_per_token=pool.bytes_per_token() + (draft.pool.bytes_per_token() if draft is not None else 0),
            make_detokenizer=self._tokenizer.detokenizer,
            namespace=f"{c.architecture}/{c.vocab_size}/{c.hidden_size}/{c.num_layers}",
            activation_bytes_per_token=self._runner.activation_bytes_per_token,
            guides=self._guides)
        model_ref, self._model_inbox = mailbox("model", 1)
        self._submit, self._scheduler_inbox = mailbox("scheduler", self._scheduler_config.mailbox_size)
        self._model_actor = ModelActor(self._runner, c.vocab_size, c.eos_token_ids, sampler=self._sampler,
                                       thread=self._compute, draft=self._draft_runner,
                                       share_cpu=self.config.runtime.share_cpu)
        self._scheduler_actor = SchedulerActor(scheduler, model_ref)
        log.info("engine ready: %d KV blocks of %d tokens (%d tokens)", pool.num_blocks, pool.block_size,
                 pool.num_blocks * pool.block_size)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._supervise)
        except BaseException as exc:
            await self._tg.__aexit__(type(exc), exc, exc.__traceback__)
            self._model_actor.close()
            self._compute.shutdown(wait=False)
            raise
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._health.status != "failed":
            self._health = Health("closed", "the engine was shut down", self._health.restarts)
        self._submit.close()  # the scheduler answers what is open with engine_closed, then ends
        if exc is not None:
            self._tg.cancel_scope.cancel()  # the body failed or was cancelled: do not drain
        # Not handed the body's exception: it propagates as itself, not wrapped in a group.
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            self._model_actor.close()
            self._compute.shutdown(wait=False)

    async def _supervise(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(partial(serve, "model", self._model_inbox, self._run_step, restart=self._restart_model))
                await tg.start(self._scheduler_actor.run, self._scheduler_inbox)
                self._health = Health("ok")
                task_status.started()
        except Exception as exc:
            # Logged and kept, not raised: raising here would cancel the caller's task before
            # its clients read the Error events the scheduler actor just sent them.
            log.error("engine actors failed; the engine is closed", exc_info=exc)
            self.error = exc
            if self._health.status != "failed":
                self._health = Health("failed", f"{type(exc).__name__}: {exc}"[:500], self._health.restarts)
        finally:
            self._submit.close()

    async def _run_step(self, plan: Any) -> Any:
        result = await self._model_actor.handle(plan)
        self._consecutive_failures = 0
        return result

    async def _restart_model(self, exc: Exception) -> bool:
        """The model actor's restart policy (actor.serve): a fresh actor over the same runner,
        after restart_delay_s; False (give up) after max_failures failed steps in a row."""
        self._consecutive_failures += 1
        reason = f"a model step failed: {type(exc).__name__}: {exc}"[:500]
        restarts = self._health.restarts
        if self._consecutive_failures >= self.config.supervision.max_failures:
            self._health = Health("failed", f"{self._consecutive_failures} model steps failed in a row; "
                                            f"the last: {reason}", restarts)
            return False
        self._health = Health("restarting", reason, restarts + 1)
        log.error("restarting the model actor (%s)", reason)
        old, self._model_actor = self._model_actor, self._model_actor.restarted()
        old.close()
        await anyio.sleep(self.config.supervision.restart_delay_s)
        self._health = Health("ok", reason, restarts + 1)
        return True

    def generate(self, request: GenerateRequest) -> RequestStream:
        """The request's events: Accepted, Token..., then Finished; or an Error at any point."""
        return RequestStream(self, request)

    def _prompt_ids(self, request: GenerateRequest) -> tuple[int, ...]:
        given = [x is not None for x in (request.prompt, request.prompt_token_ids, request.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        texts = [request.prompt] if request.prompt is not None else [
            str(value) for m in request.messages or () for value in m.values()]
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("the prompt is not valid Unicode (a lone surrogate); strings must be "
                                 "Unicode scalar values") from None
        if request.prompt is not None:
            return tuple(self.tokenizer.encode(request.prompt))
        if request.messages is not None:
            tools = [dict(t) for t in request.tools] if request.tools else None
            text = self.tokenizer.apply_chat_template([dict(m) for m in request.messages], tools=tools)
            return tuple(self.tokenizer.encode(text, add_special=False))  # the template has them
        return tuple(int(t) for t in request.prompt_token_ids)

    def _closed_error(self, request_id: str) -> Error:
        """The answer to a request whose stream ended without a final event: engine_closed only
        when the engine really is closed."""
        if self._health.status == "closed":
            return Error(request_id, ENGINE_CLOSED, "the engine is closed")
        if self._health.status == "failed" or self.error is not None:
            return Error(request_id, INTERNAL, f"the engine failed: {self._health.reason or self.error!r}")
        return Error(request_id, INTERNAL, "the request's event stream ended without a final event")


class RequestStream:
    """Async iterator over one request's events. Closing it cancels the request; it closes
    itself after the final event, on any exception in the consumer's wait, and when dropped."""

    def __init__(self, engine: Engine, request: GenerateRequest) -> None:
        self._engine = engine
        self._request = request
        self._receive: Any = None
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        if self._receive is None:
            error = await self._submit()
            if error is not None:
                self._done = True
                return error
        try:
            event = await self._receive.receive()
        except anyio.EndOfStream:
            event = self._engine._closed_error(self._request.request_id)
        except BaseException:
            self.close()  # cancelled while waiting: the request goes with the consumer
            raise
        if isinstance(event, (Finished, Error)):
            self._done = True
            self.close()
        return event

    async def _submit(self) -> Error | None:
        engine, request = self._engine, self._request
        try:
            prompt_ids = engine._prompt_ids(request)
        except ValueError as exc:  # bad request shape, bad chat messages or template
            return Error(request.request_id, INVALID_PARAMS, str(exc))
        # Room for every event the request can produce (accepted, prompt logprobs if asked for, a
        # token event per token of each of its n choices, the final event), so the scheduler never
        # waits on us, plus one slot for a slow_reader error should that bound ever be wrong.
        # Buffers grow as used.
        p = request.params
        if request.params_given is not None:  # a client's request: the model's defaults fill the rest
            try:
                p = with_model_defaults(p, request.params_given, engine.tokenizer.sampling_defaults)
            except InvalidParams as exc:
                return Error(request.request_id, INVALID_PARAMS, f"{exc} (with the model's generation defaults)")
        if p.guide is not None and engine._guides is not None:
            try:  # compiled into the scheduler's cache here, in a worker thread, off the event loop
                await anyio.to_thread.run_sync(engine._guides.compile, *p.guide)
            except GuideError as exc:
                return Error(request.request_id, INVALID_PARAMS, str(exc))
        room = 2 + (p.prompt_logprobs is not None) + p.n * p.max_tokens + 1
        send, self._receive = anyio.create_memory_object_stream[Event](room)
        try:
            await engine._submit.tell(Submit(request.request_id, prompt_ids, p, send))
        except ActorFailed:
            send.close()
            return engine._closed_error(request.request_id)
        return None

    def close(self) -> None:
        if self._receive is not None:
            self._receive.close()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _guide_compiler(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GuideCompiler | None:
    """Structured output's compiler over the model's HF tokenizer (None for a tokenizer without
    one, such as a test double: guided requests are then refused)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    return GuideCompiler(backend.to_str, vocab_size, eos_token_ids)


def _device_type(runner: StepRunner) -> str:
    """Where a runner computes: its model's device; "cpu" for a test's fake runner."""
    return runner.model.device.type if isinstance(runner, ModelRunner) else "cpu"
