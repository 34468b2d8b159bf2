"""Speculative decoding cores: an n-gram drafter, batched verification, an adaptive draft length.

Model-independent: the model actor runs the target on each row's last token plus its K drafts
(one forward over K+1 positions) and hands the results here. Draft rows are padded to K with
`num_drafts` saying how many are real.

Verification (Leviathan et al. / Chen et al., 2023) emits, per row, the accepted drafts plus
one token, and the emitted tokens are distributed exactly as target sampling would give:
  - draft x_j is accepted with probability min(1, p_target(x_j) / p_draft(x_j)), stopping at
    the first rejection;
  - at a rejection the token is drawn from normalize(max(0, p_target - p_draft)) there;
  - when all drafts are accepted a bonus token is drawn from the target after the last one.
A deterministic drafter (n-gram lookup) has a one-hot p_draft: pass draft_probs=None; then
x_j is accepted with probability p_target(x_j) and the residual is p_target without x_j.
Greedy rows reduce to "accept while the draft equals the target argmax, then emit the argmax":
`verify_greedy`, or equally `verify_sampled` with one-hot target rows (sampler.sampling_probs
gives those for temperature 0). Target probabilities must be the ones sampling would use:
after penalties, temperature and truncation (sampler.sampling_probs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from edgeinfer.sampler import sample_from_probs, seeded_uniform

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


def verify_greedy(draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                  target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification. draft_ids (B, K) int64, num_drafts (B,), target_logits (B, K+1, V).
    Returns (token_ids (B, K+1), num_emitted (B,)): row b emits token_ids[b, :num_emitted[b]],
    which is exactly what greedy decoding of the target would produce."""
    target_ids = target_logits.argmax(dim=-1)  # (B, K+1)
    num_accepted = _num_accepted((draft_ids == target_ids[:, :-1]), num_drafts)
    return target_ids, num_accepted + 1


def verify_sampled(
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification. draft_ids (B, K) int64, num_drafts (B,), target_probs
    (B, K+1, V), draft_probs (B, K, V) or None for one-hot drafts, uniforms (B, K+1) in (0, 1)
    (K for the accept tests, one for the final token). Returns (token_ids (B, K+1),
    num_emitted (B,)) as verify_greedy."""
    num_rows, k = draft_ids.shape
    rows = torch.arange(num_rows, device=draft_ids.device)
    p_target = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # (B, K)
    if draft_probs is None:
        p_draft = torch.ones_like(p_target)
    else:
        p_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    # u < p_t / p_d without dividing: p_d > 0 wherever the draft was actually sampled from it.
    accepted = uniforms[:, :k].to(p_target.dtype) * p_draft < p_target
    num_accepted = _num_accepted(accepted, num_drafts)  # (B,)

    final_target = target_probs[rows, num_accepted]  # (B, V)
    dist = final_target
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            final_draft = torch.nn.functional.one_hot(draft_ids[rows, at], target_probs.shape[-1])
        else:
            final_draft = draft_probs[rows, at]
        residual = (final_target - final_draft.to(final_target.dtype)).clamp(min=0)
        # A zero residual means target == draft, where rejection has probability 0; rounding
        # can still reject, and the target is then the right distribution to fall back on.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, final_target)
        rejected = num_accepted < num_drafts
        dist = torch.where(rejected[:, None], residual, final_target)
    token_ids = torch.cat([draft_ids, draft_ids.new_zeros(num_rows, 1)], dim=-1)
    token_ids[rows, num_accepted] = sample_from_probs(dist, uniforms[:, k])
    return token_ids, num_accepted + 1


def verify_uniforms(seed: int | None, choice: int, step: int, num_drafts: int,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """The (num_drafts + 1,) uniforms verify_sampled takes for one row: the accept tests, then
    the final draw. Seeded rows derive them from (seed, choice, step) on counter streams 1 and 2
    (plain sampling uses no stream counter), so seeded output stays reproducible."""
    if seed is None:
        return torch.rand(num_drafts + 1, dtype=torch.float64, generator=generator)
    values = [seeded_uniform(seed, choice, step + j, 1) for j in range(num_drafts)]
    values.append(seeded_uniform(seed, choice, step, 2))
    return torch.tensor(values, dtype=torch.float64)


def _num_accepted(accepted: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Length of each row's run of accepted drafts from the start, padding counting as rejected."""
    real = torch.arange(accepted.shape[-1], device=accepted.device)[None, :] < num_drafts[:, None]
    return (accepted & real).to(torch.int64).cumprod(dim=-1).sum(dim=-1)


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
