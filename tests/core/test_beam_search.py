"""Beam search: equals brute-force search when wide enough, greedy at width 1, and a plain
list-based reference at small widths, on a tiny random 'model' (a table of next-token logprobs
indexed by position and last token)."""

import itertools
import math

import pytest
import torch

from edgeinfer.core.beam_search import BeamSearchParams, beam_search

VOCAB = 4
EOS = 0


def make_model(seed: int, vocab: int = VOCAB):
    """Next-token logprobs depend on the last token and the position, so that no two different
    sequences tie (with the last token alone, reordered transitions would sum equal)."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.log_softmax(torch.randn(8, vocab, vocab, generator=gen) * 2, dim=-1)  # (pos, last, next)

    def logprobs(prefix) -> torch.Tensor:  # (V,)
        return tables[len(prefix) % 8, prefix[-1]]

    def step_fn(prefixes: list[list[int]]) -> list[list[tuple[int, float]]]:  # every token a candidate
        return [list(enumerate(logprobs(p).tolist())) for p in prefixes]

    return logprobs, step_fn


def brute_force(logprobs, prompt: list[int], max_tokens: int, alpha: float):
    """Every finishable sequence with its summed logprob and score, best first."""
    results = []
    for length in range(1, max_tokens + 1):
        for body in itertools.product(range(1, VOCAB), repeat=length - 1):
            for last in range(VOCAB):
                tokens = body + (last,)
                if last != EOS and length < max_tokens:
                    continue  # unfinished: neither EOS nor max length
                logprob = sum(logprobs(prompt + list(tokens[:i]))[t].item() for i, t in enumerate(tokens))
                results.append((logprob / length**alpha, logprob, tokens))
    return sorted(results, key=lambda r: -r[0])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("alpha", [1.0, 0.0, -0.5, 2.0])
def test_wide_enough_never_stopping_search_is_exact(seed, max_tokens, alpha):
    logprobs, step_fn = make_model(seed)
    params = BeamSearchParams(width=(VOCAB - 1) ** max_tokens, max_tokens=max_tokens, num_results=5
                              if max_tokens > 1 else 1, length_penalty=alpha, early_stopping="never",
                              eos_token_ids=[EOS])
    got = beam_search([2], step_fn, params)
    expected = brute_force(logprobs, [2], max_tokens, alpha)[:params.num_results]
    assert [h.token_ids for h in got] == [tokens for _, _, tokens in expected]
    for hyp, (score, logprob, _) in zip(got, expected, strict=True):
        assert hyp.score == pytest.approx(score, abs=1e-5)
        assert hyp.logprob == pytest.approx(logprob, abs=1e-5)
        assert hyp.finish_reason == ("eos" if hyp.token_ids[-1] == EOS else "length")


@pytest.mark.parametrize("seed", range(5))
def test_width_one_with_early_stopping_is_greedy(seed):
    logprobs, step_fn = make_model(seed)
    tokens = []
    while len(tokens) < 6 and EOS not in tokens:
        tokens.append(int(logprobs([3, *tokens]).argmax()))
    params = BeamSearchParams(width=1, max_tokens=6, early_stopping=True, eos_token_ids=[EOS])
    assert beam_search([3], step_fn, params)[0].token_ids == tuple(tokens)


def reference_beam_search(logprobs, vocab, prompt, params):
    """The same rules, written with plain lists and sorting."""
    beams, finished = [((), 0.0)], []
    eos = set(params.eos_token_ids)
    score = lambda lp, n: lp / n**params.length_penalty
    for step in range(1, params.max_tokens + 1):
        candidates = sorted(((lp + logprobs(prompt + list(t))[v].item(), t + (v,))
                             for t, lp in beams for v in range(vocab)), key=lambda c: -c[0])
        candidates = candidates[:params.width * (1 + len(eos))]
        beams = []
        for rank, (lp, tokens) in enumerate(candidates):
            if tokens[-1] in eos:
                if rank < params.width:
                    finished.append((score(lp, step), tokens))
            elif len(beams) < params.width:
                beams.append((tokens, lp))
        finished = sorted(finished, key=lambda f: -f[0])[:params.width]
        if len(finished) == params.width and step < params.max_tokens and params.early_stopping != "never":
            if params.early_stopping is True or score(beams[0][1], step) <= finished[-1][0]:
                break  # "never" runs to max_tokens here: beam_search must stop only when that is moot
    else:
        finished = sorted(finished + [(score(lp, len(t)), t) for t, lp in beams], key=lambda f: -f[0])
    return [tokens for _, tokens in finished[:params.num_results]]


@pytest.mark.parametrize("vocab, max_tokens", [(5, 5), (3, 6)])
@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("alpha", [1.0, -0.5, 2.0])
def test_small_widths_match_reference(vocab, max_tokens, width, early_stopping, alpha):
    for seed in range(12):  # enough that a wrong "never" bound shows (it did, in about 1 of 4)
        logprobs, step_fn = make_model(100 + seed, vocab)
        params = BeamSearchParams(width=width, max_tokens=max_tokens, num_results=width,
                                  length_penalty=alpha, early_stopping=early_stopping, eos_token_ids=[EOS])
        got = beam_search([1], step_fn, params)
        assert [h.token_ids for h in got] == reference_beam_search(logprobs, vocab, [1], params)
        assert all(a.score >= b.score for a, b in itertools.pairwise(got))


def test_step_fn_sees_prompt_plus_prefix_and_at_most_width_rows():
    seen = []
    _, step_fn = make_model(7)

    def recording_step(prefixes):
        seen.append(prefixes)
        return step_fn(prefixes)

    beam_search([3, 1], recording_step, BeamSearchParams(width=2, max_tokens=3, eos_token_ids=[EOS]))
    assert seen[0] == [[3, 1]]
    assert all(len(p) <= 2 and all(q[:2] == [3, 1] for q in p) for p in seen)


def test_params_are_validated():
    with pytest.raises(ValueError, match="num_results"):
        BeamSearchParams(width=2, max_tokens=4, num_results=3)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(width=2, max_tokens=4, early_stopping="sometimes")
    assert math.isfinite(BeamSearchParams(width=1, max_tokens=1).length_penalty)
