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


def reference_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """The distribution a sampled token is drawn from, by the textbook definition one token at a
    time in float64: temperature, top-k, top-p over the top-k, min-p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda t: -probs[t].item())
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t].item() for t in kept)
    if top_p < 1:
        prefix, total = [], 0.0
        for t in kept:
            prefix.append(t)
            total += probs[t].item() / mass
            if total >= top_p:
                break
        kept = prefix
    kept = [t for t in kept if probs[t] >= min_p * probs[order[0]]]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()
