"""Scheduler: request state, admission, continuous batching, chunked prefill, preemption. Pure Python.

Writers: the scheduler is the one writer of every Sequence (status, queues, counters, detokenizer
and stop checker) and the one caller of its BlockManager, which alone writes block tables and
reference counts. It returns plain StepPlans and reads plain StepResults; it never touches the
model or the KV pool.

Algorithm. A sequence's tokens are prompt + output; the first `num_computed` have K/V in the
pool, and the block manager holds `num_slots` >= num_computed slots for it. Each `schedule()`
spends a budget of `max_num_batched_tokens` tokens: first on the running sequences, oldest
first, each getting its uncomputed tokens (one for a decode, a chunk of a prefill, which is how a
long prompt shares steps with decodes instead of stalling them); a decode first reserves the slot
of its newest token, and when no block is free the newest running sequence is preempted (blocks
freed, put back at the head of the waiting queue to be recomputed later; its output so far is
kept, so nothing is emitted twice) until the append fits or the sequence preempted itself. Then,
unless this step preempted, waiting sequences are admitted in arrival order while the budget,
`max_num_seqs` and the blocks allow: a sequence is admitted when the blocks of its whole
lifetime (prompt plus max_tokens, capped by the context) plus the watermark are available, or
when nothing runs; it then gets blocks for all its current tokens at once (reusing cached prefix
blocks) and its first chunk. Since any admitted sequence fits the pool alone and preemption
always takes the newest, the oldest running sequence always progresses: no livelock, no
deadlock. A chunk that reaches the sequence's last token samples its next token;
`postprocess()` commits computed blocks for prefix sharing, runs the stop checks and finishes
sequences, whose blocks are freed at once so a waiting request can join the next step.

Parallel sampling (n > 1). A request starts as one sequence, choice 0. Its first sampling step
draws n tokens from the one prompt's logits (SeqStep.choices), then `postprocess` forks choices
1..n-1 from it: they share every prompt block and copy the partial last one on their first
append (copy-on-write). From then on each choice is an ordinary running sequence (own stop
checks, preemptible alone); the request finishes, with every choice in `Finished.choices`, when
its last choice does. Admission counts the blocks of all n choices' lifetimes.

Speculative decoding (SchedulerConfig.speculative = "ngram"). While few sequences run, a
decoding sequence may carry prompt-lookup drafts: its step feeds (last token, *drafts), whose
slots are reserved first (never by preempting anyone: no free blocks, no drafts), and the model
returns the accepted drafts plus one sampled token (edgeinfer.worker.verify's rejection rule, so
the output distribution is the target's). Rejected drafts' slots stay reserved and are simply
overwritten later (num_slots may exceed the tokens). num_computed then counts only verified
tokens. Each sequence's AdaptiveK sets its draft length from its acceptance rate.

Beam search (SamplingParams.beam_width > 0). The request starts as one sequence; every live
beam is an ordinary running sequence whose sampling step instead returns its best next tokens
with log-probabilities (SeqStep.beam_candidates). Once every live beam of the group has
reported (usually in one step; a preempted beam reports after its recompute), the group's
BeamState picks the next beams, each forked from its parent in the block manager (shared blocks,
copy-on-write on the first append), and the parents are released. Nothing streams during the
search: when it ends, each of the n best hypotheses comes as one Token event (its index), then
one Finished listing them with their scores.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from edgeinfer.config import SchedulerConfig
from edgeinfer.core.beam_search import BeamSearchParams, BeamState
from edgeinfer.core.block_manager import BlockManager
from edgeinfer.core.events import (
    INTERNAL,
    INVALID_PARAMS,
    OVERLOADED,
    PROMPT_TOO_LONG,
    Accepted,
    Error,
    Event,
    Finished,
    RequestError,
    Token,
    TokenLogprob,
    Usage,
)
from edgeinfer.core.messages import SeqStep, StepPlan, StepResult
from edgeinfer.core.sampling_params import InvalidParams, SamplingParams
from edgeinfer.core.speculative import PROMPT_LOOKUP_NGRAM_MIN, AdaptiveK, propose_ngram
from edgeinfer.core.stop import StopChecker

log = logging.getLogger(__name__)


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...


@dataclass
class BeamGroup:
    """A beam search request's live beams (aligned with state.beams) and this round's reports."""

    request_id: str
    prompt_len: int
    arrival_s: float
    state: BeamState
    seqs: list[SeqState]
    reported: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)  # seq id -> candidates


@dataclass
class SeqState:
    seq_id: int
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped by the context and the pool
    arrival_s: float
    detokenizer: Detokenizer
    stop: StopChecker
    index: int = 0  # choice index (n > 1)
    draft_k: AdaptiveK = field(default_factory=AdaptiveK)  # speculative draft length
    to_fork: int = 0  # choices still to fork from this one at its first sample (n - 1, then 0)
    finish_reason: str | None = None
    beam: BeamGroup | None = None
    output_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V is in the pool
    num_slots: int = 0  # token slots the block manager holds for it (0: no blocks)
    block_table: tuple[int, ...] = ()
    num_cached_tokens: int = 0  # prefix-cache hits at first admission
    peak_blocks: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    prefix_hit_rate: float
    num_generated_tokens: int
    num_preemptions: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, num_blocks: int, block_size: int, max_model_len: int,
                 vocab_size: int, eos_token_ids: Sequence[int], bytes_per_token: int,
                 make_detokenizer: Callable[[], Detokenizer], namespace: str = "",
                 clock: Callable[[], float] = time.monotonic, activation_bytes_per_token: int = 0) -> None:
        """``activation_bytes_per_token`` (a worst-case step's measured peak per token, CUDA)
        caps a step's tokens by the free device memory each StepResult reports; 0: no cap."""
        self.config = config
        self.block_manager = BlockManager(num_blocks, block_size, namespace)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_seq_len = min(max_model_len, num_blocks * block_size)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.bytes_per_token = bytes_per_token
        self._make_detokenizer = make_detokenizer
        self._clock = clock
        self._watermark = int(config.kv_watermark * num_blocks)
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []  # in admission order: newest last
        self._by_request: dict[str, list[SeqState]] = {}  # a request's choices, finished ones included
        self._by_seq: dict[int, SeqState] = {}
        self._next_seq_id = 0
        self._next_step_id = 0
        self.num_generated_tokens = 0
        self.num_preemptions = 0
        self.activation_bytes_per_token = activation_bytes_per_token
        self._free_step_bytes: int | None = None  # from the last StepResult
        self.num_memory_capped_steps = 0

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Accepted:
        """Queue a request, or raise RequestError (invalid_params, prompt_too_long, overloaded)."""
        if request_id in self._by_request:
            raise RequestError(INVALID_PARAMS, f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise RequestError(INVALID_PARAMS, "the prompt is empty")
        width = max(params.n, params.beam_width)
        if width > self.config.max_num_seqs:
            raise RequestError(INVALID_PARAMS, f"n / beam_width is {width}; at most max_num_seqs = "
                                               f"{self.config.max_num_seqs} sequences run at once")
        try:
            params.check_vocab(self.vocab_size)
        except InvalidParams as exc:
            raise RequestError(INVALID_PARAMS, str(exc)) from None
        if params.max_tokens > self.max_model_len:
            raise RequestError(INVALID_PARAMS, f"max_tokens must be at most the model's context of "
                                               f"{self.max_model_len} tokens, got {params.max_tokens}")
        if not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise RequestError(INVALID_PARAMS, f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_seq_len:
            raise RequestError(PROMPT_TOO_LONG, (
                f"the prompt has {len(prompt_ids)} tokens; at most {self.max_seq_len - 1} fit "
                f"(context and KV pool of {self.block_manager.num_blocks * self.block_size} tokens)"))
        if len(self.waiting) >= self.config.max_waiting:
            raise RequestError(OVERLOADED, f"{len(self.waiting)} requests are already waiting",
                               self.config.retry_after_s)
        max_len = min(len(prompt_ids) + params.max_tokens, self.max_seq_len)
        if self._lifetime_blocks(len(prompt_ids), max_len, width) > self.block_manager.num_blocks:
            raise RequestError(INVALID_PARAMS, (
                f"{width} sequences of {max_len} tokens (n / beam_width) do not fit the KV pool of "
                f"{self.block_manager.num_blocks * self.block_size} tokens; lower n, beam_width or max_tokens"))
        seq = SeqState(self._next_seq_id, request_id, tuple(prompt_ids), params, max_len, self._clock(),
                       self._make_detokenizer(), StopChecker(params, self.eos_token_ids),
                       to_fork=0 if params.beam_width else params.n - 1)
        if params.beam_width:
            eos = () if params.ignore_eos else self.eos_token_ids
            search = BeamSearchParams(params.beam_width, max_len - len(prompt_ids), params.n, params.length_penalty,
                                      params.early_stopping, tuple(dict.fromkeys((*eos, *params.stop_token_ids))))
            seq.beam = BeamGroup(request_id, len(prompt_ids), seq.arrival_s, BeamState(search), [seq])
        self._next_seq_id += 1
        position = len(self.waiting)
        self.waiting.append(seq)
        self._by_request[request_id] = [seq]
        self._by_seq[seq.seq_id] = seq
        return Accepted(request_id, position, len(prompt_ids))

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone): its blocks are free when this returns."""
        choices = self._by_request.pop(request_id, None)
        if choices is None:
            return False
        for seq in choices:
            if seq.finish_reason is None:
                self._drop(seq)
        return True

    def fail_request(self, request_id: str, why: str) -> list[Event]:
        """End a request whose processing failed: its blocks freed, an internal_error for it."""
        if not self.abort(request_id):
            return []
        return [Error(request_id, INTERNAL, why)]

    def fail_step(self, plan: StepPlan, why: str) -> list[Event]:
        """The model step of `plan` failed: fail every request it carried (others keep going)."""
        request_ids = dict.fromkeys(self._by_seq[s.seq_id].request_id for s in plan.seqs if s.seq_id in self._by_seq)
        return [event for request_id in request_ids for event in self.fail_request(request_id, why)]

    @property
    def request_ids(self) -> list[str]:
        return list(self._by_request)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Decide the next step (see the module docstring); the plan may be empty."""
        budget = self._step_budget()
        steps: list[SeqStep] = []
        copies: list[tuple[int, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.beam is not None and seq.seq_id in seq.beam.reported:
                i += 1  # waits for the rest of its group before it has a new token
                continue
            if seq.num_slots < len(seq.prompt_ids) + len(seq.output_ids):
                fits, copy, did_preempt = self._append_or_preempt(seq)
                preempted |= did_preempt
                if not fits:
                    break  # it was the newest: every sequence after it is gone too
                copies.extend(copy)
            drafts = self._drafts(seq, budget - 1, copies)
            steps.append(self._step(seq, budget, drafts))
            budget -= len(steps[-1].token_ids)
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs and self._can_admit(self.waiting[0])):
            seq = self.waiting[0]
            allocation = self.block_manager.allocate(seq.seq_id, seq.token_ids)
            if allocation is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.block_table = allocation.block_ids
            seq.num_slots = len(seq.prompt_ids) + len(seq.output_ids)
            seq.num_computed = allocation.num_cached_tokens
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = self._clock()
                seq.num_cached_tokens = allocation.num_cached_tokens
            steps.append(self._step(seq, budget))
            budget -= len(steps[-1].token_ids)
        self._next_step_id += 1
        return StepPlan(self._next_step_id - 1, tuple(steps), tuple(copies))

    def postprocess(self, plan: StepPlan, result: StepResult) -> list[Event]:
        """Apply a step's result: commit blocks, emit tokens, finish sequences. Returns events."""
        now = self._clock()
        if result.free_device_bytes is not None:
            self._free_step_bytes = result.free_device_bytes
        rows: dict[int, int] = {}  # seq id -> its first row (a fork's n choices have n rows)
        for row, seq_id in enumerate(result.seq_ids):
            rows.setdefault(seq_id, row)
        row_tokens = result.row_tokens()  # once per step: each row's emitted tokens
        failed = dict(result.failed)
        events: list[Event] = []
        for step in plan.seqs:
            seq = self._by_seq.get(step.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            if seq.seq_id in failed:
                events.extend(self.fail_request(seq.request_id, failed[seq.seq_id]))
                continue
            try:
                events.extend(self._apply(seq, step, result, rows, row_tokens, now))
            except Exception as exc:  # a bug one request's data reaches fails that request alone
                log.exception("request %s: applying its step failed", seq.request_id)
                events.extend(self.fail_request(seq.request_id, f"{type(exc).__name__}: {exc}"[:500]))
        return events

    def _apply(self, seq: SeqState, step: SeqStep, result: StepResult, rows: dict[int, int],
               row_tokens: list[tuple[int, ...]], now: float) -> list[Event]:
        """One sequence's share of a step's result."""
        seq.peak_blocks = max(seq.peak_blocks, len(seq.block_table))
        if step.draft_ids:
            return self._emit_verified(seq, step, row_tokens[rows[seq.seq_id]], now)
        seq.num_computed = step.start_pos + len(step.token_ids)
        self.block_manager.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        if not step.sample:
            return []
        if step.beam_candidates:
            assert seq.beam is not None and result.top_logprobs is not None
            seq.beam.reported[seq.seq_id] = result.top_logprobs[rows[seq.seq_id]]
            return self._advance_beams(seq.beam, now) if len(seq.beam.reported) == len(seq.beam.seqs) else []
        row = rows[seq.seq_id]  # the first of len(step.choices) rows
        # Fork before the parent takes its token: children share the prompt, not its output.
        children = [self._fork(seq, index) for index in step.choices[1:]]
        events: list[Event] = []
        for offset, choice in enumerate([seq, *children]):
            events.extend(self._emit_tokens(choice, row_tokens[row + offset], now,
                                            self._logprobs(choice, result, row + offset)))
        return events

    def _emit_verified(self, seq: SeqState, step: SeqStep, tokens: tuple[int, ...], now: float) -> list[Event]:
        """A drafted step: the accepted drafts and the sampled token, K/V valid up to the last
        accepted draft."""
        num_accepted = len(tokens) - 1
        seq.draft_k = seq.draft_k.update(len(step.draft_ids), num_accepted)
        seq.num_computed = step.start_pos + 1 + num_accepted
        events = self._emit_tokens(seq, tokens, now, None)
        if seq.seq_id in self._by_seq:  # still running: its verified full blocks become shareable
            self.block_manager.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        return events

    def _emit_tokens(self, seq: SeqState, tokens: tuple[int, ...], now: float,
                     logprobs: tuple[TokenLogprob, ...] | None) -> list[Event]:
        """Append tokens (several after accepted drafts) until one finishes the sequence; the
        rest are dropped. One Token event with their text."""
        taken: list[int] = []
        text, reason = "", None
        for token_id in tokens:
            seq.output_ids.append(token_id)
            taken.append(token_id)
            piece, reason = seq.stop.push(token_id, seq.detokenizer.push(token_id))
            text += piece
            if reason is None and len(seq.prompt_ids) + len(seq.output_ids) >= seq.max_len:
                text, reason = text + seq.stop.flush(), "length"  # the context or pool is full
            if reason is not None:
                break
        self.num_generated_tokens += len(taken)
        if seq.first_token_s is None:
            seq.first_token_s = now
        seq.last_token_s = now
        seq.text.append(text)
        events: list[Event] = [Token(seq.request_id, tuple(taken), text, now - seq.arrival_s, logprobs, seq.index)]
        if reason is not None:
            finished = self._finish(seq, reason, now)
            if finished is not None:
                events.append(finished)
        return events

    def _advance_beams(self, group: BeamGroup, now: float) -> list[Event]:
        """Every live beam reported: pick the next beams, fork them from their parents, release
        the parents; at the end of the search, the results."""
        parents = group.state.advance([group.reported[seq.seq_id] for seq in group.seqs])
        children = [] if group.state.done else [
            self._beam_child(group.seqs[p], tokens) for p, (tokens, _) in zip(parents, group.state.beams, strict=True)]
        for seq in group.seqs:  # after the forks: children keep the blocks they share
            self._drop(seq)
        group.seqs, group.reported = children, {}
        self.num_generated_tokens += len(parents)
        if group.state.done:
            return self._beam_results(group, now)
        self._by_request[group.request_id] = list(children)
        return []

    def _beam_child(self, parent: SeqState, tokens: tuple[int, ...]) -> SeqState:
        """A new beam with output ``tokens``: parent's blocks shared, or, if the parent was
        preempted while its group waited, recomputed from the head of the waiting queue."""
        # The detokenizer and stop checker are never fed for beams: the results are decoded at the end.
        child = SeqState(self._next_seq_id, parent.request_id, parent.prompt_ids, parent.params, parent.max_len,
                         parent.arrival_s, parent.detokenizer, parent.stop, beam=parent.beam,
                         output_ids=list(tokens))
        self._next_seq_id += 1
        child.num_cached_tokens, child.first_scheduled_s = parent.num_cached_tokens, parent.first_scheduled_s
        self._by_seq[child.seq_id] = child
        if parent.num_slots:
            child.block_table = self.block_manager.fork(parent.seq_id, child.seq_id)
            child.num_computed, child.num_slots = parent.num_computed, parent.num_slots
            self.running.append(child)
        else:
            self.waiting.appendleft(child)
        return child

    def _drop(self, seq: SeqState) -> None:
        """Take a beam's sequence out of its queue and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _beam_results(self, group: BeamGroup, now: float) -> list[Event]:
        """The finished search: one Token event per result (its index), then the Finished."""
        events: list[Event] = []
        choices = []
        for index, hyp in enumerate(group.state.results()):
            detokenizer = self._make_detokenizer()
            text = "".join(detokenizer.push(t) for t in hyp.token_ids)
            events.append(Token(group.request_id, hyp.token_ids, text, now - group.arrival_s, None, index))
            choices.append({"index": index, "text": text, "finish_reason": hyp.finish_reason,
                            "completion_tokens": len(hyp.token_ids), "score": hyp.score, "logprob": hyp.logprob})
        del self._by_request[group.request_id]
        usage = Usage(prompt_tokens=group.prompt_len, completion_tokens=sum(c["completion_tokens"] for c in choices),
                      ttft_s=now - group.arrival_s, total_time_s=now - group.arrival_s)
        return events + [Finished(group.request_id, choices[0]["finish_reason"], usage, choices[0]["text"],
                                  tuple(choices))]

    def _fork(self, parent: SeqState, index: int) -> SeqState:
        """Choice ``index`` of parent's request: shares parent's blocks (prompt computed, no output)."""
        child = SeqState(self._next_seq_id, parent.request_id, parent.prompt_ids, parent.params, parent.max_len,
                         parent.arrival_s, self._make_detokenizer(), StopChecker(parent.params, self.eos_token_ids),
                         index=index)
        self._next_seq_id += 1
        child.block_table = self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed, child.num_slots = parent.num_computed, parent.num_slots
        child.num_cached_tokens, child.first_scheduled_s = parent.num_cached_tokens, parent.first_scheduled_s
        parent.to_fork = 0
        self.running.append(child)
        self._by_request[parent.request_id].append(child)
        self._by_seq[child.seq_id] = child
        return child

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(len(self.running), len(self.waiting), bm.num_blocks, bm.num_used, bm.num_free,
                              bm.num_cached, bm.prefix_hit_rate, self.num_generated_tokens,
                              self.num_preemptions)

    # ---- internals -----------------------------------------------------------------------------
    def _step_budget(self) -> int:
        """max_num_batched_tokens, shrunk to the tokens whose activations the device's free
        memory (read after the last step) holds when another program has taken some; never
        below max_num_seqs, so every running sequence still decodes. Prefill chunks shrink
        first, since decodes are planned before them."""
        budget = self.config.max_num_batched_tokens
        if not self.activation_bytes_per_token or self._free_step_bytes is None:
            return budget
        fits = self._free_step_bytes // self.activation_bytes_per_token
        if fits >= budget:
            return budget
        self.num_memory_capped_steps += 1
        if self.num_memory_capped_steps == 1 or self.num_memory_capped_steps % 1000 == 0:
            log.warning("free device memory (%.0f MiB) holds a step of %d tokens, not %d: prefill slows down "
                        "(%d capped steps so far)", self._free_step_bytes / 2**20, fits, budget,
                        self.num_memory_capped_steps)
        return max(self.config.max_num_seqs, fits)

    def _step(self, seq: SeqState, budget: int, drafts: tuple[int, ...] = ()) -> SeqStep:
        token_ids = seq.token_ids
        start = seq.num_computed
        chunk = tuple(token_ids[start:start + budget]) + drafts
        sample = start + len(chunk) - len(drafts) == len(token_ids)
        wants_prompt = sample and seq.params.repetition_penalty != 1  # the only reader of the prompt
        choices = tuple(range(seq.to_fork + 1)) if sample and seq.to_fork else (seq.index,)
        beam_candidates = seq.beam.state.num_candidates if sample and seq.beam is not None else 0
        return SeqStep(seq.seq_id, chunk, start, seq.block_table, sample, seq.params,
                       tuple(seq.output_ids) if sample else (), seq.prompt_ids if wants_prompt else (), choices,
                       drafts, beam_candidates)

    def _drafts(self, seq: SeqState, budget: int, copies: list[tuple[int, int]]) -> tuple[int, ...]:
        """Prompt-lookup drafts for a decoding sequence, their slots reserved; () when
        speculation is off, the batch is wide, the request reads logprobs or penalties (their
        distribution moves with every token), or no free block is left for them."""
        p = seq.params
        if (self.config.speculative != "ngram" or len(self.running) > self.config.speculate_max_seqs
                or seq.num_computed != len(seq.prompt_ids) + len(seq.output_ids) - 1 or seq.to_fork or seq.beam
                or p.logprobs is not None or p.repetition_penalty != 1 or p.presence_penalty
                or p.frequency_penalty):
            return ()
        tokens = seq.token_ids
        limit = min(seq.draft_k.k, self.config.max_draft_tokens, budget,
                    seq.max_len - len(tokens) - 1, p.max_tokens - len(seq.output_ids) - 1)
        drafts = propose_ngram(tokens, limit, ngram_min=PROMPT_LOOKUP_NGRAM_MIN) if limit > 0 else []
        need = len(tokens) + len(drafts) - seq.num_slots
        if drafts and need > 0:
            appended = self.block_manager.append_slots(seq.seq_id, need)  # None: no room, no drafts
            if appended is None:
                return ()
            seq.block_table = appended.block_ids
            seq.num_slots += need
            if appended.copy is not None:
                copies.append((appended.copy.src_block_id, appended.copy.dst_block_id))
        return tuple(drafts)

    def _append_or_preempt(self, seq: SeqState) -> tuple[bool, list[tuple[int, int]], bool]:
        """Reserve slots for seq's uncomputed tokens, preempting the newest sequences as needed.
        Returns (seq still runs, copy-on-write orders, whether anything was preempted)."""
        num_new = len(seq.prompt_ids) + len(seq.output_ids) - seq.num_slots
        preempted = False
        while True:
            appended = self.block_manager.append_slots(seq.seq_id, num_new)
            if appended is not None:
                seq.block_table = appended.block_ids
                seq.num_slots += num_new
                copy = [(appended.copy.src_block_id, appended.copy.dst_block_id)] if appended.copy else []
                return True, copy, preempted
            victim = self.running.pop()
            self.block_manager.free(victim.seq_id)
            victim.num_computed = victim.num_slots = 0
            victim.block_table = ()
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            preempted = True
            if victim is seq:
                return False, [], preempted

    def _lifetime_blocks(self, prompt_len: int, max_len: int, n: int) -> int:
        """Blocks a request may hold at once: its first choice's lifetime, plus each other
        choice's output and one copy-on-write block."""
        own = -(-max_len // self.block_size)
        return own + (n - 1) * (-(-(max_len - prompt_len) // self.block_size) + 1)

    def _can_admit(self, seq: SeqState) -> bool:
        width = seq.to_fork + 1
        if seq.beam is not None:
            if seq.beam.state.step:
                return True  # a beam back from preemption: its group waits on it, blocks permitting
            width = seq.params.beam_width
        if width > 1 and len(self.running) + width > self.config.max_num_seqs:
            return False  # its choices / beams join the running batch at the first sample
        if not self.running:
            return True  # it fits the pool alone (checked at add_request)
        lifetime = self._lifetime_blocks(len(seq.prompt_ids), seq.max_len, width)
        return lifetime + self._watermark <= self.block_manager.num_available

    def _finish(self, seq: SeqState, reason: str, now: float) -> Finished | None:
        """Retire one choice; the request's Finished once its last choice is done."""
        self.running.remove(seq)
        self._release(seq)
        seq.finish_reason = reason
        choices = self._by_request[seq.request_id]
        if any(c.finish_reason is None for c in choices) or seq.to_fork:
            return None
        del self._by_request[seq.request_id]
        firsts = [c.first_token_s for c in choices if c.first_token_s is not None]
        lasts = [c.last_token_s for c in choices if c.last_token_s is not None]
        first, last = min(firsts, default=now), max(lasts, default=now)
        longest = max(len(c.output_ids) for c in choices)
        usage = Usage(
            prompt_tokens=len(seq.prompt_ids), completion_tokens=sum(len(c.output_ids) for c in choices),
            cached_prompt_tokens=choices[0].num_cached_tokens,
            queue_time_s=(choices[0].first_scheduled_s or now) - seq.arrival_s,
            ttft_s=first - seq.arrival_s, tpot_s=(last - first) / (longest - 1) if longest > 1 else 0.0,
            total_time_s=now - seq.arrival_s,
            # Shared prompt blocks count once per choice: an upper bound for n > 1.
            peak_kv_bytes=sum(c.peak_blocks for c in choices) * self.block_size * self.bytes_per_token)
        listed = () if len(choices) == 1 else tuple(
            {"index": c.index, "text": "".join(c.text), "finish_reason": c.finish_reason,
             "completion_tokens": len(c.output_ids)} for c in sorted(choices, key=lambda c: c.index))
        return Finished(seq.request_id, choices[0].finish_reason, usage, "".join(choices[0].text), listed)

    def _release(self, seq: SeqState) -> None:
        if seq.num_slots:
            self.block_manager.free(seq.seq_id)
            seq.num_slots = 0
        self._by_seq.pop(seq.seq_id, None)

    def _logprobs(self, seq: SeqState, result: StepResult, row: int) -> tuple[TokenLogprob, ...] | None:
        if result.logprobs is None or seq.params.logprobs is None:
            return None
        top = result.top_logprobs[row] if result.top_logprobs is not None else ()
        return (TokenLogprob(result.token_ids[row], result.logprobs[row], tuple(top)),)
