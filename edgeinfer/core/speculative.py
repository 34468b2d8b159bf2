"""Speculative decoding bookkeeping (plain Python): the n-gram drafter and the adaptive draft
length. The scheduler drafts with these; the worker verifies drafts against the target
(edgeinfer.worker.verify)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

# What the engines pass as propose_ngram's ngram_min: single-token matches drafted too eagerly in
# free text (measured acceptance 0.08); two tokens of context keep the drafts prompt lookup is for.
PROMPT_LOOKUP_NGRAM_MIN = 2


def propose_ngram(token_ids: Sequence[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt-lookup drafting: find the most recent earlier occurrence of the sequence's last
    n tokens (longest n first, ngram_max down to ngram_min) and propose up to k tokens that
    followed it. Returns [] when nothing matches."""
    if k < 0 or not 1 <= ngram_min <= ngram_max:
        raise ValueError(f"need k >= 0 and 1 <= ngram_min <= ngram_max, got {k}, {ngram_min}, {ngram_max}")
    tokens = list(token_ids)
    length = len(tokens)
    if k == 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n:]
        # Earlier occurrences only (start < length - n), so at least one token follows.
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == suffix[0] and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@dataclass(frozen=True)
class AdaptiveK:
    """Draft length for one sequence, from a running mean of its acceptance rate: long drafts
    pay when most are accepted, and waste target compute when they are not. Pure: `update`
    returns the next controller, so the scheduler stays its only writer."""

    k: int = 4
    k_min: int = 1  # >= 1: at k = 0 nothing would be drafted and the rate could never recover
    k_max: int = 8
    acceptance: float = 0.5  # running mean of accepted / drafted
    smoothing: float = 0.3  # weight of the newest step in the running mean
    grow_above: float = 0.8
    shrink_below: float = 0.4

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k <= k_max, got {self.k_min}, {self.k}, {self.k_max}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 <= self.shrink_below <= self.grow_above <= 1:
            raise ValueError(
                f"need 0 <= shrink_below <= grow_above <= 1, got {self.shrink_below}, {self.grow_above}"
            )

    def update(self, num_drafted: int, num_accepted: int) -> AdaptiveK:
        """The controller after a step that drafted num_drafted tokens and accepted num_accepted."""
        if num_drafted == 0:
            return self  # the drafter found nothing: no evidence about acceptance
        rate = num_accepted / num_drafted
        acceptance = (1 - self.smoothing) * self.acceptance + self.smoothing * rate
        k = self.k
        if acceptance >= self.grow_above:
            k += 1
        elif acceptance < self.shrink_below:
            k -= 1
        return replace(self, k=min(max(k, self.k_min), self.k_max), acceptance=acceptance)
