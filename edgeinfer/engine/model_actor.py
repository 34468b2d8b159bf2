"""ModelActor: owns the weights, the KV pool and the sampler; executes StepPlans. Decides nothing.

Writers: the actor's worker thread is the one writer of the KV pool (through the model runner's
forward and `copy_blocks`) and of the sampler's random generator. A StepPlan arrives by value;
the actor copies the blocks it names, runs one forward over every chunk, and for the rows that
ask for it samples a token (n tokens for an n > 1 request's first sample), verifies prompt-lookup
drafts (accepted drafts plus one token) or lists a beam's best next tokens, scores the prompt
tokens a prefill chunk names (SeqStep.prompt_logprob_ids), and replies a StepResult by value.
A sampling stage that raises is retried row by row, so only the requests whose rows fail alone
are failed (StepResult.failed); a failing forward fails the whole step,
which the engine's supervisor answers by restarting this actor (`restarted()`). Steps run one
at a time on the engine's compute thread (`compute_thread`: the one thread that also built the
model, for OpenMP's sake; CUDA's current device, streams and graphs are per-thread state too),
awaited by the event loop, which keeps serving clients during a forward.

With a draft model (SchedulerConfig.speculative "draft"), the draft model first writes the rows'
draft feeds into its own pool and drafts (edgeinfer.worker.draft_model); the target's forward
then verifies those drafts like prompt-lookup ones, against the draft distributions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Any, Protocol, TypeVar

import anyio
import torch

from edgeinfer.core.messages import PromptScores, SeqStep, StepPlan, StepResult
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.cpu_share import CpuShare
from edgeinfer.worker.draft_model import DraftModel
from edgeinfer.worker.model_runner import ModelRunner
from edgeinfer.worker.sampler import (
    SampleOutput,
    SamplingBatch,
    greedy_ids,
    processed_logits,
    sample,
    sampling_probs,
    takes_argmax,
)
from edgeinfer.worker.verify import verify_greedy, verify_sampled, verify_uniforms

log = logging.getLogger(__name__)
T = TypeVar("T")


class BlockPool(Protocol):
    num_blocks: int
    block_size: int

    def bytes_per_token(self) -> int: ...

    def copy_blocks(self, src_dst: list[tuple[int, int]]) -> None: ...


class StepRunner(Protocol):
    """What the model actor needs of a runner: ModelRunner, or a fake in tests."""

    pool: BlockPool
    activation_bytes_per_token: int  # 0: steps are not capped by free device memory

    def logits(self, chunks: list[SeqChunk]) -> torch.Tensor: ...

    def free_step_bytes(self) -> int | None: ...


Sampler = Callable[[torch.Tensor, SamplingBatch], SampleOutput]  # edgeinfer.worker.sampler.sample's signature


async def run_on(thread: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on ``thread``, awaited. Not abandoned on cancellation: it finishes before
    the caller goes on, so nothing touches the model or the pool after the engine has closed.
    Under asyncio the event loop waits on the thread's future itself: through an anyio worker
    thread waiting on it, a step cost ~0.45 ms more (of 7 at one stream)."""
    future = thread.submit(fn, *args)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # anyio on trio
        return await anyio.to_thread.run_sync(future.result)
    with anyio.CancelScope(shield=True):
        return await asyncio.wrap_future(future)


def compute_thread(nice: int = 0) -> ThreadPoolExecutor:
    """The thread that runs a model's torch work. One per engine, and everything parallel runs on
    it, loading and preparing the weights included: every thread that runs an OpenMP region keeps
    a pool of OpenMP threads, and once the pools hold more threads than the machine has cores,
    libgomp stops spinning between regions and wakes its threads through the kernel each time.
    A decode step runs a few hundred short regions, so on the 2-core test machine a step took
    17.2 ms on a second thread against 6.1-6.4 ms on one (tools/bench_engine_step.py).

    ``nice`` is added to the thread's niceness before it runs anything, so the OpenMP threads it
    starts inherit it (RuntimeConfig.compute_nice)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeinfer-model",
                              initializer=_lower_priority, initargs=(nice,))


def _lower_priority(nice: int) -> None:
    # Linux keeps a niceness per thread (POSIX would renice the whole process, event loop included).
    if not nice or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.warning("could not lower the compute thread's priority by %d: %s", nice, exc)


class ModelActor:
    """Runs StepPlans on a runner; `handle` is the actor's message handler (see actor.serve)."""

    def __init__(self, runner: StepRunner, vocab_size: int, eos_token_ids: tuple[int, ...],
                 seed: int = 0, sampler: Sampler = sample, thread: ThreadPoolExecutor | None = None,
                 draft: ModelRunner | None = None, share_cpu: bool = False) -> None:
        """``thread``: the one-worker executor that runs every step (the engine's compute
        thread, which also built the runner); None: the actor makes its own. ``draft``: the draft
        model's runner, whose pool has the target pool's blocks. ``share_cpu``: a CPU model's steps
        run on the cores other programs leave (worker/cpu_share.py)."""
        self.runner = runner
        on_cpu = isinstance(runner, ModelRunner) and runner.model.device.type == "cpu"
        self._cpu_share = CpuShare() if share_cpu and on_cpu else None
        self.draft = None if draft is None else DraftModel(draft, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._seed = seed
        self._sampler = sampler
        self._generator = torch.Generator().manual_seed(seed)  # unseeded requests draw from it
        self._owns_thread = thread is None
        self._thread = thread or compute_thread()

    def restarted(self) -> ModelActor:
        """A fresh actor (new generator, the same compute thread) over the same runner, after a
        failed step."""
        actor = ModelActor(self.runner, self.vocab_size, self.eos_token_ids, self._seed + 1, self._sampler,
                           None if self._owns_thread else self._thread,
                           None if self.draft is None else self.draft.runner)
        actor._cpu_share = self._cpu_share  # it knows the configured threads, which it may have lowered
        return actor

    async def handle(self, plan: StepPlan) -> StepResult:
        return await run_on(self._thread, self.execute, plan)

    def close(self) -> None:
        if self._owns_thread:
            self._thread.shutdown(wait=False)

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, synchronously (tests call this directly); the result carries the device's
        free memory read after the step, for the scheduler's next plan."""
        if self._cpu_share is not None:
            self._cpu_share.adjust()
        return dataclasses.replace(self._step(plan), free_device_bytes=self.runner.free_step_bytes())

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> StepResult:
        if plan.block_copies:
            self.runner.pool.copy_blocks(list(plan.block_copies))
            if self.draft is not None:
                self.draft.runner.pool.copy_blocks(list(plan.block_copies))
        drafts: dict[int, tuple[int, ...]] = {}  # row -> the draft model's drafts
        draft_probs = None
        if self.draft is not None and any(s.draft_feed for s in plan.seqs):
            proposed, draft_probs = self.draft.propose(list(plan.seqs), self._generator)
            drafts = dict(zip([i for i, s in enumerate(plan.seqs) if s.model_drafts], proposed, strict=True))
        # Logits for each chunk's last token, for every draft position of a chunk with drafts, and
        # for the positions that score prompt tokens; rows of unfinished prefill chunks are dropped.
        chunks = [SeqChunk(s.token_ids + drafts.get(i, ()), s.start_pos, s.block_table, num_logits=_num_logits(s),
                           prompt_tokens=s.prompt_tokens)
                  for i, s in enumerate(plan.seqs)]
        logits = self.runner.logits(chunks)
        ends = list(accumulate(c.num_logits for c in chunks))  # each chunk's last logits row + 1
        prompt_scores, prompt_failed = self._prompt_logprobs(plan, logits, ends)
        plain = [i for i, s in enumerate(plan.seqs) if s.sample and not s.num_drafts and not s.beam_candidates]
        drafted = [i for i, s in enumerate(plan.seqs) if s.sample and s.num_drafts]
        beams = [i for i, s in enumerate(plan.seqs) if s.sample and s.beam_candidates]
        if not plain and not drafted and not beams:
            return StepResult(plan.step_id, (), (), failed=prompt_failed, prompt_logprobs=prompt_scores)
        rows: dict[int, list[tuple[tuple[int, ...], float, tuple]]] = {}  # seq index -> (tokens, logprob, top)
        failed: dict[int, str] = {}  # seq id -> why its row failed
        self._contained(plan, plain, rows, failed, lambda idx, out: self._sample_plain(
            plan, idx, _rows(logits, [ends[i] - 1 for i in idx for _ in plan.seqs[i].choices]), out))
        self._contained(plan, drafted, rows, failed, lambda idx, out: self._verify_drafts(
            plan, idx, logits, ends, drafts, draft_probs, out))
        self._contained(plan, beams, rows, failed, lambda idx, out: self._beam_candidates(
            plan, idx, _rows(logits, [ends[i] - 1 for i in idx]), out))
        order = [(plan.seqs[i].seq_id, row) for i in sorted(rows) for row in rows[i]]
        seq_ids = tuple(seq_id for seq_id, _ in order)
        token_ids = tuple(t for _, (tokens, _, _) in order for t in tokens)
        num_emitted = tuple(len(tokens) for _, (tokens, _, _) in order) if drafted else None
        wants_logprobs = bool(beams) or any(plan.seqs[i].params.logprobs is not None for i in plain)
        logprobs = tuple(lp for _, (_, lp, _) in order) if wants_logprobs else None
        top = tuple(t for _, (_, _, t) in order) if wants_logprobs else None
        return StepResult(plan.step_id, seq_ids, token_ids, logprobs, top, num_emitted,
                          failed=tuple(failed.items()) + prompt_failed, prompt_logprobs=prompt_scores)

    def _prompt_logprobs(self, plan: StepPlan, logits: torch.Tensor,
                         ends: list[int]) -> tuple[tuple[PromptScores, ...], tuple[tuple[int, str], ...]]:
        """The scores of every row's SeqStep.prompt_logprob_ids, and the rows that failed."""
        asking = [i for i, s in enumerate(plan.seqs) if s.prompt_logprob_ids]
        if not asking:
            return (), ()
        rows: dict[int, list] = {}
        failed: dict[int, str] = {}
        self._contained(plan, asking, rows, failed, lambda idx, out: self._score_prompt(plan, idx, logits, ends, out))
        return tuple(rows[i][0] for i in asking if i in rows), tuple(failed.items())

    @staticmethod
    def _score_prompt(plan: StepPlan, indices: list[int], logits: torch.Tensor, ends: list[int],
                      rows: dict[int, list]) -> None:
        """log_softmax of the raw logits (as vLLM's prompt_logprobs: no sampling parameter applies),
        at each position before a scored token, as the logit minus the row's logsumexp: no second
        (tokens, vocab) tensor beside the logits."""
        for i in indices:
            s = plan.seqs[i]
            last = ends[i] - s.sample  # a sampled row's last logits row predicts the first output token
            scores = logits[last - len(s.prompt_logprob_ids):last]  # (tokens, vocab), a view
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            targets = torch.tensor(s.prompt_logprob_ids, device=scores.device)[:, None]
            chosen = (scores.gather(-1, targets) - lse).squeeze(-1).tolist()
            k = min(s.params.prompt_logprobs or 0, scores.shape[-1])
            top: tuple = ()
            if k:
                top_lps, top_ids = scores.topk(k, dim=-1)
                top = tuple(tuple(zip(ids, lps, strict=True))
                            for ids, lps in zip(top_ids.tolist(), (top_lps - lse).tolist(), strict=True))
            rows[i] = [PromptScores(s.seq_id, tuple(chosen), top)]

    def _contained(self, plan: StepPlan, indices: list[int], rows: dict[int, list], failed: dict[int, str],
                   stage: Callable[[list[int], dict[int, list]], None]) -> None:
        """Run a sampling stage over its rows at once; if it raises, row by row, so that one
        request's failure (a bug its parameters reach) fails that request alone."""
        if not indices:
            return
        try:
            out: dict[int, list] = {}
            stage(indices, out)
            rows.update(out)
            return
        except Exception:
            if len(indices) > 1:
                log.warning("a batched sampling stage failed; retrying its %d rows one by one", len(indices))
        for i in indices:
            try:
                out = {}
                stage([i], out)
                rows.update(out)
            except Exception as exc:
                log.exception("sampling failed for sequence %d", plan.seqs[i].seq_id)
                failed[plan.seqs[i].seq_id] = f"sampling failed: {type(exc).__name__}: {exc}"[:500]

    def _sample_plain(self, plan: StepPlan, indices: list[int], logits: torch.Tensor,
                      rows: dict[int, list]) -> None:
        """One token per choice: an n > 1 request's first sample draws n tokens from one row. A step
        whose rows all take their logits' argmax (sampler.takes_argmax) skips the sampler."""
        sampled = [plan.seqs[i] for i in indices for _ in plan.seqs[i].choices]
        if all(takes_argmax(s.params, s.num_output, bool(s.guide_masks)) for s in sampled):
            token_ids = iter(greedy_ids(logits).tolist())
            for i in indices:
                rows[i] = [((next(token_ids),), 0.0, ()) for _ in plan.seqs[i].choices]
            return
        batch = SamplingBatch.from_params(
            [s.params for s in sampled], [s.prompt_ids for s in sampled],
            [s.output_ids for s in sampled], self.vocab_size, self.eos_token_ids,
            choice_indices=[c for i in indices for c in plan.seqs[i].choices],
            device=logits.device, generator=self._generator,
            guide_masks=[s.guide_masks[0] if s.guide_masks else b"" for s in sampled],
            num_outputs=[s.num_output for s in sampled],
        )
        out = self._sampler(logits, batch)
        token_ids = out.token_ids.tolist()
        chosen = out.logprobs.tolist() if out.logprobs is not None else [0.0] * len(sampled)
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        r = 0
        for i in indices:
            k = plan.seqs[i].params.logprobs or 0
            for _ in plan.seqs[i].choices:
                top = tuple(zip(top_ids[r][:k], top_lps[r][:k], strict=True)) if top_ids is not None else ()
                rows.setdefault(i, []).append(((token_ids[r],), chosen[r], top))
                r += 1

    def _beam_candidates(self, plan: StepPlan, indices: list[int], logits: torch.Tensor,
                         rows: dict[int, list]) -> None:
        """Each beam row's best next tokens by log-probability of its logits (logit_bias applied)."""
        seqs = [plan.seqs[i] for i in indices]
        batch = SamplingBatch.from_params([s.params for s in seqs], [s.prompt_ids for s in seqs],
                                          [s.output_ids for s in seqs], self.vocab_size, self.eos_token_ids,
                                          device=logits.device, num_outputs=[s.num_output for s in seqs])
        logprobs = torch.log_softmax(processed_logits(logits, batch), dim=-1)
        top_lps, top_ids = logprobs.topk(min(max(s.beam_candidates for s in seqs), logprobs.shape[-1]), dim=-1)
        for i, s, ids, lps in zip(indices, seqs, top_ids.tolist(), top_lps.tolist(), strict=True):
            k = s.beam_candidates
            rows[i] = [((ids[0],), lps[0], tuple(zip(ids[:k], lps[:k], strict=True)))]

    def _verify_drafts(self, plan: StepPlan, indices: list[int], logits: torch.Tensor, ends: list[int],
                       model_drafts: dict[int, tuple[int, ...]], draft_probs: torch.Tensor | None,
                       rows: dict[int, list]) -> None:
        """Rejection-rule verification of drafted rows in one padded batch: prompt-lookup drafts
        (one-hot draft distributions) or the draft model's, drawn from ``draft_probs`` (its rows
        in plan order; None when they were all greedy). Greedy rows reduce to 'accept while
        equal to the argmax'."""
        seqs = [plan.seqs[i] for i in indices]
        drafts = [s.draft_ids or model_drafts[i] for i, s in zip(indices, seqs, strict=True)]
        k = max(len(d) for d in drafts)
        positions = []  # (row, j) -> logits row; padding repeats the row's last position
        for i, d in zip(indices, drafts, strict=True):
            first = ends[i] - 1 - len(d)
            positions.extend(first + min(j, len(d)) for j in range(k + 1))
        histories = [list(s.output_ids) + list(d[:j]) for s, d in zip(seqs, drafts, strict=True) for j in range(k + 1)]
        generated = [s.num_output + min(j, len(d)) for s, d in zip(seqs, drafts, strict=True) for j in range(k + 1)]
        expanded = [s for s in seqs for _ in range(k + 1)]
        batch = SamplingBatch.from_params(
            [s.params for s in expanded], [s.prompt_ids for s in expanded], histories, self.vocab_size,
            self.eos_token_ids, choice_indices=[s.choices[0] for s in expanded], device=logits.device,
            generator=self._generator, guide_masks=[  # padding positions repeat the last real one's
                s.guide_masks[min(j, len(d))] if s.guide_masks else b""
                for s, d in zip(seqs, drafts, strict=True) for j in range(k + 1)],
            num_outputs=generated)
        draft_ids = torch.tensor([list(d) + [0] * (k - len(d)) for d in drafts], device=logits.device)
        num_drafts = torch.tensor([len(d) for d in drafts], device=logits.device)
        if batch.all_greedy:  # argmax only: no softmax over the vocabulary per position
            processed = processed_logits(logits[positions], batch).view(len(seqs), k + 1, -1)
            token_ids, emitted = verify_greedy(draft_ids, num_drafts, processed)
        else:
            probs = sampling_probs(logits[positions], batch).view(len(seqs), k + 1, -1)
            uniforms = torch.stack([verify_uniforms(s.params.seed, s.choices[0], s.num_output, k,
                                                    self._generator) for s in seqs]).to(logits.device)
            q = None
            if draft_probs is not None:
                order = sorted(model_drafts)  # draft_probs' rows
                q = draft_probs[[order.index(i) for i in indices], :k]
            token_ids, emitted = verify_sampled(draft_ids, num_drafts, probs, q, uniforms)
        for i, ids, n in zip(indices, token_ids.tolist(), emitted.tolist(), strict=True):
            rows[i] = [(tuple(ids[:n]), 0.0, ())]


def _rows(logits: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """logits[indices], without the copy when that is every row in order (a plain decode step:
    ~17 us of a 49152-token row)."""
    return logits if indices == list(range(logits.shape[0])) else logits[indices]


def _num_logits(s: SeqStep) -> int:
    """Logits rows a step needs of one sequence: its last position's (sampled, or a prefill chunk's
    and dropped) and every draft position's; or, when it scores prompt tokens, the positions before
    them (the chunk's last ones, or those just before its sampled last one) and a sampled one."""
    if s.prompt_logprob_ids:
        return len(s.prompt_logprob_ids) + s.sample
    return 1 + s.num_drafts
