"""What a step's sampled tokens become: Token events through each sequence's stop checker and
detokenizer, and a request's Finished (with its usage) once its last choice ends, its blocks freed
at once so a waiting request can join the next step."""

from __future__ import annotations

from edgeinfer.core.events import Event, Finished, Token, TokenLogprob, Usage
from edgeinfer.core.messages import StepResult
from edgeinfer.core.sequence import SeqState


class OutputMixin:
    """Methods of edgeinfer.core.scheduler.Scheduler, kept apart by job: they read and write its state."""

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
            if reason is None and seq.guide is not None:
                seq.guide.advance(token_id)
                if seq.guide.is_complete:  # the grammar takes nothing more: the answer is whole
                    text, reason = text + seq.stop.flush(), "stop"
            if reason is None and len(seq.prompt_ids) + len(seq.output_ids) >= seq.max_len:
                text, reason = text + seq.stop.flush(), "length"  # the context or pool is full
            if reason is not None:
                break
        self.num_generated_tokens += len(taken)
        if seq.times.first_token_s is None:
            seq.times.first_token_s = now
        seq.times.last_token_s = now
        seq.text.append(text)
        events: list[Event] = [Token(seq.request_id, tuple(taken), text, now - seq.arrival_s, logprobs, seq.index)]
        if reason is not None:
            finished = self._finish(seq, reason, now)
            if finished is not None:
                events.append(finished)
        return events

    def _finish(self, seq: SeqState, reason: str, now: float) -> Finished | None:
        """Retire one choice; the request's Finished once its last choice is done."""
        self.running.remove(seq)
        self._release(seq)
        seq.finish_reason = reason
        choices = self._by_request[seq.request_id]
        if any(c.finish_reason is None for c in choices) or seq.to_fork:
            return None
        del self._by_request[seq.request_id]
        firsts = [c.times.first_token_s for c in choices if c.times.first_token_s is not None]
        lasts = [c.times.last_token_s for c in choices if c.times.last_token_s is not None]
        first, last = min(firsts, default=now), max(lasts, default=now)
        longest = max(len(c.output_ids) for c in choices)
        usage = Usage(
            prompt_tokens=len(seq.prompt_ids), completion_tokens=sum(len(c.output_ids) for c in choices),
            cached_prompt_tokens=choices[0].kv.num_cached_tokens,
            queue_time_s=(choices[0].times.first_scheduled_s or now) - seq.arrival_s,
            ttft_s=first - seq.arrival_s, tpot_s=(last - first) / (longest - 1) if longest > 1 else 0.0,
            total_time_s=now - seq.arrival_s,
            # Shared prompt blocks count once per choice: an upper bound for n > 1.
            peak_kv_bytes=sum(c.kv.peak_blocks for c in choices) * self.block_size * self.bytes_per_token)
        listed = () if len(choices) == 1 else tuple(
            {"index": c.index, "text": "".join(c.text), "finish_reason": c.finish_reason,
             "completion_tokens": len(c.output_ids)} for c in sorted(choices, key=lambda c: c.index))
        return Finished(seq.request_id, choices[0].finish_reason, usage, "".join(choices[0].text), listed)

    def _release(self, seq: SeqState) -> None:
        if seq.kv.num_slots:
            self.block_manager.free(seq.seq_id)
            seq.kv.num_slots = 0
        self._by_seq.pop(seq.seq_id, None)

    def _logprobs(self, seq: SeqState, result: StepResult, row: int) -> tuple[TokenLogprob, ...] | None:
        if result.logprobs is None or seq.params.logprobs is None:
            return None
        top = result.top_logprobs[row] if result.top_logprobs is not None else ()
        return (TokenLogprob(result.token_ids[row], result.logprobs[row], tuple(top)),)
