"""Forks: the choices of parallel sampling and the beams of beam search, sharing their parent's blocks.

Parallel sampling (n > 1). A request starts as one sequence, choice 0. Its first sampling step
draws n tokens from the one prompt's logits (SeqStep.choices), then `postprocess` forks choices
1..n-1 from it: they share every prompt block and copy the partial last one on their first
append (copy-on-write). From then on each choice is an ordinary running sequence (own stop
checks, preemptible alone); the request finishes, with every choice in `Finished.choices`, when
its last choice does. Admission counts the blocks of all n choices' lifetimes.

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

from edgeinfer.core.events import Event, Finished, Token, Usage
from edgeinfer.core.sequence import BeamGroup, SeqState
from edgeinfer.core.stop import StopChecker


class ForkMixin:
    """Methods of edgeinfer.core.scheduler.Scheduler, kept apart by job: they read and write its state."""

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
        child.kv.num_cached_tokens = parent.kv.num_cached_tokens
        child.times.first_scheduled_s = parent.times.first_scheduled_s
        self._by_seq[child.seq_id] = child
        if parent.kv.num_slots:
            child.kv.block_table = self.block_manager.fork(parent.seq_id, child.seq_id)
            child.kv.num_computed, child.kv.num_slots = parent.kv.num_computed, parent.kv.num_slots
            child.spec.draft_computed = parent.spec.draft_computed
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
                         index=index, guide=None if parent.guide is None else parent.guide.copy())
        self._next_seq_id += 1
        child.kv.block_table = self.block_manager.fork(parent.seq_id, child.seq_id)
        child.kv.num_computed, child.kv.num_slots = parent.kv.num_computed, parent.kv.num_slots
        child.spec.draft_computed = parent.spec.draft_computed
        child.kv.num_cached_tokens = parent.kv.num_cached_tokens
        child.times.first_scheduled_s = parent.times.first_scheduled_s
        parent.to_fork = 0
        self.running.append(child)
        self._by_request[parent.request_id].append(child)
        self._by_seq[child.seq_id] = child
        return child
