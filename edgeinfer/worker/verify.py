"""Speculative decoding: batched verification of drafts against the target model.

Drafts come from the scheduler's n-gram lookup (edgeinfer.core.speculative) or a draft model;
the model actor runs the target on each row's last token plus its K drafts (one forward over
K+1 positions) and hands the results here. Draft rows are padded to K with `num_drafts` saying
how many are real.

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

import torch

from edgeinfer.worker.sampler import greedy_ids, sample_from_probs, seeded_uniform


def verify_greedy(draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                  target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification. draft_ids (B, K) int64, num_drafts (B,), target_logits (B, K+1, V).
    Returns (token_ids (B, K+1), num_emitted (B,)): row b emits token_ids[b, :num_emitted[b]],
    which is exactly what greedy decoding of the target would produce."""
    target_ids = greedy_ids(target_logits)  # (B, K+1)
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
