"""Speculative decoding's bookkeeping in the scheduler: which decoding sequences draft, the slots
their drafts take, what the draft model must be fed, and what a verified step leaves behind.

Two drafters (SchedulerConfig.speculative). "ngram": prompt lookup here, the ids ride in
SeqStep.draft_ids. "draft": a draft model in the worker drafts SeqStep.model_drafts tokens; its
KV pool shares the target's block tables, and SeqState.spec.draft_computed counts the leading positions
it holds. It is fed each prompt chunk beside the target, and at a drafting step everything from
draft_computed to the newest token (what it missed while the batch was too wide to draft). That
catch-up is capped at max_num_batched_tokens tokens: positions skipped, like positions a prefix
cache hit brought in, hold whatever the draft pool had there. A stale draft K/V only lowers the
acceptance rate, never the output: the rejection rule checks every draft against the target.

Either way a drafting step feeds (last token, *drafts) to the target, whose slots are reserved
first (never by preempting anyone: no free blocks, no drafts), and returns the accepted drafts
plus one sampled token. Rejected drafts' slots stay reserved and are overwritten later (num_slots
may exceed the tokens). Each sequence's AdaptiveK sets its draft length from its acceptance rate.
"""

from __future__ import annotations

from edgeinfer.core.events import Event
from edgeinfer.core.messages import SeqStep
from edgeinfer.core.sequence import SeqState
from edgeinfer.core.speculative import PROMPT_LOOKUP_NGRAM_MIN, propose_ngram


class SpeculationMixin:
    """Methods of edgeinfer.core.scheduler.Scheduler, kept apart by job: they read and write its state."""

    def _may_draft(self, seq: SeqState) -> bool:
        """Whether this sequence's requests allow drafting at all: not while it forks or runs a
        beam, not when it reads logprobs or penalties (their distribution moves with every
        accepted token), and a guided one only with prompt lookup (a draft model's drafts are
        not known when the scheduler computes the masks of their positions)."""
        p = seq.params
        return (self.config.speculative != "off" and not seq.to_fork and seq.beam is None and p.logprobs is None
                and not p.penalised and (seq.guide is None or self.config.speculative == "ngram"))

    def _drafts(self, seq: SeqState, budget: int, copies: list[tuple[int, int]]) -> tuple[tuple[int, ...], int]:
        """(prompt-lookup drafts, number of draft-model drafts) for a decoding sequence, their
        slots reserved; none while the batch is wide or no free block is left for them."""
        if not self._may_draft(seq) or len(self.running) > self.config.speculate_max_seqs:
            return (), 0
        tokens = seq.token_ids  # a copy of the whole sequence: only where drafting may run
        if seq.kv.num_computed != len(tokens) - 1:
            return (), 0
        p = seq.params
        limit = min(seq.spec.draft_k.k, self.config.max_draft_tokens, budget,
                    seq.max_len - len(tokens) - 1, p.max_tokens - len(seq.output_ids) - 1)
        if limit <= 0:
            return (), 0
        ids = propose_ngram(tokens, limit, ngram_min=PROMPT_LOOKUP_NGRAM_MIN) if self.config.speculative == "ngram" \
            else []
        if seq.guide is not None:
            ids = ids[:seq.guide.num_valid(ids)]  # a draft the grammar refuses could never be accepted
        num = len(ids) if self.config.speculative == "ngram" else limit
        need = len(tokens) + num - seq.kv.num_slots
        if num and need > 0:
            appended = self.block_manager.append_slots(seq.seq_id, need)  # None: no room, no drafts
            if appended is None:
                return (), 0
            seq.kv.block_table = appended.block_ids
            seq.kv.num_slots += need
            if appended.copy is not None:
                copies.append((appended.copy.src_block_id, appended.copy.dst_block_id))
        return tuple(ids), (0 if ids else num)

    def _draft_feed(self, seq: SeqState, start: int, num_new: int, model_drafts: int) -> tuple[tuple[int, ...], int]:
        """(tokens, position of the first) the draft model writes this step: a drafting step's
        catch-up to the newest token, or the prompt chunk the target computes."""
        if self.config.speculative != "draft" or not self._may_draft(seq):
            return (), 0
        tokens = seq.token_ids
        if model_drafts:
            first = max(seq.spec.draft_computed, len(tokens) - self.config.max_num_batched_tokens)
            return tuple(tokens[first:]), first
        if start < len(tokens) - 1:  # a prompt (or recompute) chunk, not a decode
            return tuple(tokens[start:start + num_new]), start
        return (), 0

    def _emit_verified(self, seq: SeqState, step: SeqStep, tokens: tuple[int, ...], now: float) -> list[Event]:
        """A drafted step: the accepted drafts and the sampled token, K/V valid up to the last
        accepted draft (in the draft pool too, except a last draft, which it was never fed)."""
        num_accepted = len(tokens) - 1
        seq.spec.draft_k = seq.spec.draft_k.update(step.num_drafts, num_accepted)
        seq.kv.num_computed = step.start_pos + 1 + num_accepted
        if step.model_drafts:
            seq.spec.draft_computed = step.draft_start + len(step.draft_feed) + min(num_accepted, step.model_drafts - 1)
        events = self._emit_tokens(seq, tokens, now, None)
        if seq.seq_id in self._by_seq:  # still running: its verified full blocks become shareable
            self.block_manager.commit(seq.seq_id, seq.tokens(), seq.kv.num_computed)
        return events
