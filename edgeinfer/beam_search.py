"""Beam search over a step function, independent of the model and the KV cache.

`beam_search(prompt_ids, step_fn, params)` calls `step_fn(prefixes)` with the live beams' full
token lists (prompt + generated) and expects (B, V) next-token logprobs. The scheduler's real
step function will run the model on those beams, whose KV blocks it shares by forking them
through the block manager; this module only decides which prefixes live.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

StepFn = Callable[[list[list[int]]], torch.Tensor]


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


def beam_search(prompt_ids: Sequence[int], step_fn: StepFn, params: BeamSearchParams) -> list[Hypothesis]:
    """The best `params.num_results` hypotheses, best first."""
    width, eos_ids = params.width, set(params.eos_token_ids)
    score = lambda logprob, num_tokens: logprob / num_tokens**params.length_penalty
    beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]  # (generated token ids, logprob)
    finished: list[Hypothesis] = []  # best first, at most width

    def add(hyp: Hypothesis) -> None:
        finished.append(hyp)
        finished.sort(key=lambda h: -h.score)
        del finished[width:]

    for step in range(1, params.max_tokens + 1):
        logprobs = step_fn([list(prompt_ids) + list(tokens) for tokens, _ in beams])  # (B, V)
        beam_logprobs = torch.tensor([lp for _, lp in beams], dtype=torch.float64)
        candidates = (beam_logprobs[:, None] + logprobs.to(torch.float64)).flatten()  # (B * V,)
        num_best = min(candidates.numel(), width * (1 + len(eos_ids)))
        top_values, top_index = candidates.topk(num_best)
        next_beams = []
        for rank, (value, index) in enumerate(zip(top_values.tolist(), top_index.tolist(), strict=True)):
            if value == -math.inf:
                break
            beam, token_id = divmod(index, logprobs.shape[-1])
            tokens = beams[beam][0] + (token_id,)
            if token_id in eos_ids:
                if rank < width:
                    add(Hypothesis(tokens, value, score(value, step), "eos"))
            elif len(next_beams) < width:
                next_beams.append((tokens, value))
        beams = next_beams
        if not beams or _done(params, finished, beams[0][1], step, score):
            break
    else:
        for tokens, value in beams:
            add(Hypothesis(tokens, value, score(value, len(tokens)), "length"))
    return finished[:params.num_results]


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
