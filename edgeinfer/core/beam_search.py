"""Beam search over a step function, independent of the model and the KV cache (plain Python).

`beam_search(prompt_ids, step_fn, params)` calls `step_fn(prefixes)` with the live beams' full
token lists (prompt + generated) and expects, per beam, its next-token candidates as (token id,
logprob) pairs: the beam's top `BeamState.num_candidates` tokens are all a step can use, so the
worker sends only those (all of them is fine too). The scheduler advances a BeamState with the
model's candidates for beams whose KV blocks it shares by forking them through the block
manager; this module only decides which prefixes live.

The algorithm (as Hugging Face's): keep `width` live beams ranked by summed logprob. Each step
every live beam is extended by every token; among the best width * (1 + #eos) candidates (so
at least `width` of them do not end in EOS), an EOS candidate ranked within the first `width`
becomes a finished hypothesis, and the first `width` non-EOS candidates become the next live
beams. Beams alive at max_tokens finish with reason "length". A hypothesis scores
sum_logprob / num_tokens ** length_penalty, num_tokens counting the EOS; only the best `width`
finished hypotheses are kept. Search ends when `width` hypotheses are finished and:
  early_stopping=True     at once;
  early_stopping=False    the best live beam, scored at its current length, cannot beat the
                          worst kept hypothesis (a heuristic);
  early_stopping="never"  no live beam can beat it at any length up to max_tokens (exact).
With width at least the number of possible prefixes, "never" returns the true best sequences.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Candidates = Sequence[tuple[int, float]]  # one beam's (next token id, logprob) pairs
StepFn = Callable[[list[list[int]]], Sequence[Candidates]]


@dataclass(frozen=True)
class BeamSearchParams:
    width: int
    max_tokens: int
    num_results: int = 1  # the n best hypotheses returned, n <= width
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.width < 1:
            raise ValueError(f"beam width must be >= 1, got {self.width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 1 <= self.num_results <= self.width:
            raise ValueError(f"num_results must be in [1, width={self.width}], got {self.num_results}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens, ending with the EOS when finish_reason is "eos"
    logprob: float  # summed
    score: float  # logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "eos" or "length"


class BeamState:
    """One search's progress, advanced a step at a time: `beam_search` loops over it; the
    scheduler advances it once per model step with the live beams' next-token logprobs."""

    def __init__(self, params: BeamSearchParams) -> None:
        self.params = params
        self.beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]  # (generated token ids, logprob)
        self.finished: list[Hypothesis] = []  # best first, at most width
        self.step = 0
        self.done = False

    @property
    def num_candidates(self) -> int:
        """Candidates a step ranks: each beam's top this-many tokens are all it can contribute."""
        return self.params.width * (1 + len(self.params.eos_token_ids))

    def advance(self, candidates: Sequence[Candidates]) -> list[int]:
        """Extend the live beams by their next-token candidates (one list per live beam, in
        order); returns, for each new live beam, the index of the beam it extends."""
        p, eos_ids = self.params, set(self.params.eos_token_ids)
        self.step += 1
        # Ties rank by beam, then token id: a deterministic order the worker's batching cannot change.
        ranked = heapq.nsmallest(self.num_candidates, (
            (-(beam_logprob + logprob), beam, token_id)
            for beam, ((_, beam_logprob), beam_candidates) in enumerate(zip(self.beams, candidates, strict=True))
            for token_id, logprob in beam_candidates))
        next_beams, parents = [], []
        for rank, (negated, beam, token_id) in enumerate(ranked):
            value = -negated
            if value == -math.inf:
                break
            tokens = self.beams[beam][0] + (token_id,)
            if token_id in eos_ids:
                if rank < p.width:
                    self._add(Hypothesis(tokens, value, self._score(value, self.step), "eos"))
            elif len(next_beams) < p.width:
                next_beams.append((tokens, value))
                parents.append(beam)
        self.beams = next_beams
        if not next_beams or _done(p, self.finished, next_beams[0][1], self.step, self._score):
            self.done = True
        elif self.step == p.max_tokens:
            for tokens, value in next_beams:
                self._add(Hypothesis(tokens, value, self._score(value, len(tokens)), "length"))
            self.done = True
        return parents

    def results(self) -> list[Hypothesis]:
        """The best `num_results` hypotheses, best first (complete once `done`)."""
        return self.finished[:self.params.num_results]

    def _score(self, logprob: float, num_tokens: int) -> float:
        return logprob / num_tokens**self.params.length_penalty

    def _add(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.params.width:]


def beam_search(prompt_ids: Sequence[int], step_fn: StepFn, params: BeamSearchParams) -> list[Hypothesis]:
    """The best `params.num_results` hypotheses, best first."""
    state = BeamState(params)
    while not state.done:
        state.advance(step_fn([list(prompt_ids) + list(tokens) for tokens, _ in state.beams]))
    return state.results()


def _done(params: BeamSearchParams, finished: list[Hypothesis], best_logprob: float, step: int,
          score: Callable[[float, int], float]) -> bool:
    """Whether no live beam (best summed logprob best_logprob, step tokens long) can still get
    into the kept hypotheses. Logprobs are <= 0, so a beam's sum only falls as it grows."""
    if len(finished) < params.width or step == params.max_tokens:
        return False  # at max_tokens the live beams finish by length and compete as they are
    if params.early_stopping is True:
        return True
    worst = finished[-1].score
    if params.early_stopping is False:
        return score(best_logprob, step) <= worst
    # Exact bound: a beam finishing at length L >= step + 1 scores at most best_logprob / L**alpha,
    # largest at L = max_tokens for alpha > 0 and at the next length otherwise.
    length = params.max_tokens if params.length_penalty > 0 else step + 1
    return score(best_logprob, length) <= worst
