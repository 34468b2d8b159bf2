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

Speculative decoding (SchedulerConfig.speculative "ngram" or "draft"). While few sequences run, a
decoding sequence may carry drafts, which the model verifies (edgeinfer.worker.verify's rejection
rule, so the output distribution is the target's); num_computed then counts only verified tokens.
drafting.py holds that bookkeeping.

Structured output: a guided sequence's grammar state (SeqState.guide, edgeinfer.core.guides)
gives each sampling step its token masks, takes every emitted token, and ends the sequence
when the grammar is complete.

Siblings hold the rest of the scheduler's methods, by job: admission.py (add_request and the
admission rule), drafting.py (speculative decoding), forks.py (parallel sampling's choices and
beam search's beams), output.py (tokens through stop checks and detokenizers, finished requests
and their usage), prompt_logprobs.py (scoring prompt tokens); sequence.py holds the per-sequence
state they all write.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from edgeinfer.config import SchedulerConfig
from edgeinfer.core.admission import AdmissionMixin
from edgeinfer.core.block_manager import BlockManager
from edgeinfer.core.drafting import SpeculationMixin
from edgeinfer.core.events import INTERNAL, Error, Event
from edgeinfer.core.forks import ForkMixin
from edgeinfer.core.guides import GuideCompiler
from edgeinfer.core.messages import SeqStep, StepPlan, StepResult
from edgeinfer.core.output import OutputMixin
from edgeinfer.core.prompt_logprobs import gather_prompt_logprobs, prompt_logprob_ids
from edgeinfer.core.sequence import Detokenizer, SchedulerStats, SeqState

log = logging.getLogger(__name__)


class Scheduler(AdmissionMixin, ForkMixin, OutputMixin, SpeculationMixin):
    def __init__(self, config: SchedulerConfig, *, num_blocks: int, block_size: int, max_model_len: int,
                 vocab_size: int, eos_token_ids: Sequence[int], bytes_per_token: int,
                 make_detokenizer: Callable[[], Detokenizer], namespace: str = "",
                 clock: Callable[[], float] = time.monotonic, activation_bytes_per_token: int = 0,
                 guides: GuideCompiler | None = None) -> None:
        """``activation_bytes_per_token`` (a worst-case step's measured peak per token, CUDA)
        caps a step's tokens by the free device memory each StepResult reports; 0: no cap.
        ``guides`` compiles structured output's guides (None: guided requests are refused).
        ``config``'s step token budget must be settled (SchedulerConfig.for_device)."""
        if config.max_num_batched_tokens is None:
            raise ValueError("SchedulerConfig.max_num_batched_tokens is None: settle it for the device first "
                             "(SchedulerConfig.for_device)")
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
        self.guides = guides
        self._free_step_bytes: int | None = None  # from the last StepResult
        self.num_memory_capped_steps = 0

    # ---- requests ------------------------------------------------------------------------------
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
            if seq.kv.num_slots < len(seq.prompt_ids) + len(seq.output_ids):
                fits, copy, did_preempt = self._append_or_preempt(seq)
                preempted |= did_preempt
                if not fits:
                    break  # it was the newest: every sequence after it is gone too
                copies.extend(copy)
            steps.append(self._step(seq, budget, *self._drafts(seq, budget - 1, copies)))
            budget -= len(steps[-1].token_ids) + steps[-1].model_drafts  # the model appends its drafts
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs and self._can_admit(self.waiting[0])):
            seq = self.waiting[0]
            # Cached positions have no logits: a sequence still scoring its prompt computes all.
            allocation = self.block_manager.allocate(seq.seq_id, seq.token_ids, use_cache=seq.prompt_logprobs is None)
            if allocation is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.kv.block_table = allocation.block_ids
            seq.kv.num_slots = len(seq.prompt_ids) + len(seq.output_ids)
            seq.kv.num_computed = seq.spec.draft_computed = allocation.num_cached_tokens
            if seq.times.first_scheduled_s is None:
                seq.times.first_scheduled_s = self._clock()
                seq.kv.num_cached_tokens = allocation.num_cached_tokens
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
        seq.kv.peak_blocks = max(seq.kv.peak_blocks, len(seq.kv.block_table))
        events = gather_prompt_logprobs(seq, step, result) if seq.prompt_logprobs is not None else []
        if step.num_drafts:  # (a prompt's last token may carry drafts)
            return events + self._emit_verified(seq, step, row_tokens[rows[seq.seq_id]], now)
        if step.draft_feed:
            seq.spec.draft_computed = step.draft_start + len(step.draft_feed)
        seq.kv.num_computed = step.start_pos + len(step.token_ids)
        self.block_manager.commit(seq.seq_id, seq.tokens(), seq.kv.num_computed)
        if not step.sample:
            return events
        if step.beam_candidates:
            assert seq.beam is not None and result.top_logprobs is not None
            seq.beam.reported[seq.seq_id] = result.top_logprobs[rows[seq.seq_id]]
            return self._advance_beams(seq.beam, now) if len(seq.beam.reported) == len(seq.beam.seqs) else []
        row = rows[seq.seq_id]  # the first of len(step.choices) rows
        # Fork before the parent takes its token: children share the prompt, not its output.
        children = [self._fork(seq, index) for index in step.choices[1:]]
        for offset, choice in enumerate([seq, *children]):
            events.extend(self._emit_tokens(choice, row_tokens[row + offset], now,
                                            self._logprobs(choice, result, row + offset)))
        return events

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

    def _step(self, seq: SeqState, budget: int, drafts: tuple[int, ...] = (), model_drafts: int = 0) -> SeqStep:
        tokens = seq.tokens()
        start = seq.kv.num_computed
        new = tokens[start:start + budget]
        chunk = new + drafts
        sample = start + len(new) == len(tokens)
        wants_prompt = sample and seq.params.repetition_penalty != 1  # the only reader of the prompt
        wants_output = sample and seq.params.penalised
        choices = tuple(range(seq.to_fork + 1)) if sample and seq.to_fork else (seq.index,)
        beam_candidates = seq.beam.state.num_candidates if sample and seq.beam is not None else 0
        scored = prompt_logprob_ids(seq, start, start + len(new)) if seq.prompt_logprobs is not None else ()
        feed, feed_start = self._draft_feed(seq, start, len(new), model_drafts)
        masks = seq.guide.masks(drafts) if sample and seq.guide is not None else ()
        return SeqStep(seq.seq_id, chunk, start, seq.kv.block_table, sample, seq.params,
                       tuple(seq.output_ids) if wants_output else (), seq.prompt_ids if wants_prompt else (),
                       choices, drafts, beam_candidates, feed, feed_start, model_drafts, scored, masks,
                       prompt_tokens=max(0, min(len(new), len(seq.prompt_ids) - start)), num_output=len(seq.output_ids))

    def _append_or_preempt(self, seq: SeqState) -> tuple[bool, list[tuple[int, int]], bool]:
        """Reserve slots for seq's uncomputed tokens, preempting the newest sequences as needed.
        Returns (seq still runs, copy-on-write orders, whether anything was preempted)."""
        num_new = len(seq.prompt_ids) + len(seq.output_ids) - seq.kv.num_slots
        preempted = False
        while True:
            appended = self.block_manager.append_slots(seq.seq_id, num_new)
            if appended is not None:
                seq.kv.block_table = appended.block_ids
                seq.kv.num_slots += num_new
                copy = [(appended.copy.src_block_id, appended.copy.dst_block_id)] if appended.copy else []
                return True, copy, preempted
            victim = self.running.pop()
            self.block_manager.free(victim.seq_id)
            victim.kv.num_computed = victim.kv.num_slots = victim.spec.draft_computed = 0
            victim.kv.block_table = ()
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            preempted = True
            if victim is seq:
                return False, [], preempted

