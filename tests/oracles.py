"""Statistical oracles for tests whose answer is a distribution (speculative sampling, the
sampler): independent of the code under test."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value of counts against probs (zero-probability
    outcomes must never occur)."""
    counts, probs = counts.double(), probs.double()
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * counts.sum()
    stat = ((counts[probs > 0] - expected) ** 2 / expected).sum()
    df = torch.tensor(float((probs > 0).sum() - 1))
    return torch.special.gammaincc(df / 2, stat / 2).item()  # chi2 survival function
