"""StopChecker: when one sequence is finished, and which of its text may reach the client yet.

The scheduler owns one checker per sequence (its only writer) and feeds it every sampled token
with the text delta its incremental detokenizer produced for it. `push` answers with the text
that is safe to stream now and, once the sequence is done, a finish reason:

  "stop"    a stop token id, or a stop string in the text (the text is cut before it);
  "eos"     an EOS token, unless ignore_eos;
  "length"  max_tokens generated.

Invariant of the holdback: the held text is the longest suffix of everything seen that is a
proper prefix of some stop string. Any later occurrence of a stop string therefore starts inside
held + new text, so searching there finds it, and nothing emitted can be part of one. The
finishing token's own text is dropped for stop/EOS token ids (like a stop string, it is not
output); whatever is held is released at any finish that is not a stop string.

Before min_tokens tokens no stop condition applies (the sampler also masks EOS and stop token
ids until then; see SamplingBatch.suppress_*), and max_tokens >= min_tokens by validation.
"""

from __future__ import annotations

from collections.abc import Iterable

from edgeinfer.core.sampling_params import SamplingParams


class StopChecker:
    """Stop conditions and streamed-text holdback for one sequence."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
        self._params = params
        self._eos_token_ids = frozenset(eos_token_ids)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._held = ""
        self._num_tokens = 0
        self._finish_reason: str | None = None

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def push(self, token_id: int, text_delta: str) -> tuple[str, str | None]:
        """Take one generated token and its detokenized text; return (text to emit, finish
        reason or None). Pushing after a finish is a caller bug."""
        assert self._finish_reason is None, "token pushed after the sequence finished"
        self._num_tokens += 1
        past_min = self._num_tokens > self._params.min_tokens
        if past_min and token_id in self._stop_token_ids:
            return self._finish("stop")
        if past_min and token_id in self._eos_token_ids and not self._params.ignore_eos:
            return self._finish("eos")

        text = self._held + text_delta
        if past_min:
            cut = self._first_stop(text)
            if cut is not None:
                self._held = ""
                self._finish_reason = "stop"
                return text[:cut], "stop"
        if self._num_tokens >= self._params.max_tokens:
            self._held = text
            return self._finish("length")
        num_held = self._longest_stop_prefix(text)
        self._held = text[len(text) - num_held:]
        return text[:len(text) - num_held], None

    def flush(self) -> str:
        """Release held text when the sequence ends for a reason outside the checker (the
        context is full, the request is cancelled)."""
        held, self._held = self._held, ""
        return held

    def _finish(self, reason: str) -> tuple[str, str]:
        self._finish_reason = reason
        return self.flush(), reason

    def _first_stop(self, text: str) -> int | None:
        """Index where the earliest stop string in text starts, or None."""
        starts = [i for i in (text.find(s) for s in self._params.stop) if i >= 0]
        return min(starts, default=None)

    def _longest_stop_prefix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_stop_len - 1), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self._params.stop):
                return length
        return 0
