"""Speculative decoding: n-gram drafting, greedy verification reproduces target greedy decoding,
sampled verification reproduces the target's distribution (chi-square on tiny random 'models'),
the adaptive draft length."""

import pytest
import torch
from oracles import chi_square_pvalue

from edgeinfer.core.speculative import AdaptiveK, propose_ngram
from edgeinfer.worker.verify import verify_greedy, verify_sampled

VOCAB = 4


@pytest.mark.parametrize("token_ids, k, kwargs, expected", [
    ([1, 2, 3, 4, 1, 2], 3, {}, [3, 4, 1]),  # [4, 1, 2] unseen; [1, 2] seen at 0
    ([1, 5, 9, 1, 6, 9, 1], 1, {"ngram_max": 1}, [6]),  # the most recent match wins
    ([1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3], 2, {}, [9, 5]),  # the longest n-gram wins
    ([1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3], 2, {"ngram_max": 2}, [8, 1]),
    ([1, 2, 1, 2], 5, {}, [1, 2]),  # fewer than k follow the match
    ([4, 5, 6], 3, {}, []),  # no match
    ([4, 5, 6, 5], 3, {"ngram_min": 2}, []),  # only a 1-gram matches
    ([7], 3, {}, []),
    ([], 3, {}, []),
    ([1, 1, 1], 0, {}, []),
])
def test_propose_ngram(token_ids, k, kwargs, expected):
    assert propose_ngram(token_ids, k, **kwargs) == expected


def test_propose_ngram_checks_its_arguments():
    with pytest.raises(ValueError, match="ngram_min"):
        propose_ngram([1, 2], 2, ngram_max=1, ngram_min=2)


def test_greedy_speculation_with_ngram_drafts_equals_target_greedy():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(8, 8, generator=gen)  # target next-token logits, by last token
    prompts = [[1, 2, 3], [5], [0, 7, 7, 0], [4, 4]]
    length, max_k = 24, 4

    expected = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(length):
            tokens.append(int(table[tokens[-1]].argmax()))
        expected.append(tokens[len(prompt):])

    sequences = [list(p) for p in prompts]
    num_accepted = 0
    while min(len(s) - len(p) for s, p in zip(sequences, prompts, strict=True)) < length:
        drafts = [propose_ngram(s, max_k) for s in sequences]
        draft_ids = torch.tensor([d + [0] * (max_k - len(d)) for d in drafts])  # (B, K) padded
        num_drafts = torch.tensor([len(d) for d in drafts])
        contexts = torch.cat([torch.tensor([[s[-1]] for s in sequences]), draft_ids], dim=1)
        token_ids, num_emitted = verify_greedy(draft_ids, num_drafts, table[contexts])
        for seq, row, n in zip(sequences, token_ids.tolist(), num_emitted.tolist(), strict=True):
            seq.extend(row[:n])
        num_accepted += int((num_emitted - 1).sum())
    assert [s[len(p):len(p) + length] for s, p in zip(sequences, prompts, strict=True)] == expected
    assert num_accepted > 0  # the drafts did get used


def speculative_sample(target: torch.Tensor, draft: torch.Tensor, one_hot_drafts: bool, num_rows: int,
                       k: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """(num_rows, length) tokens generated from last token 0 by speculative rounds; target and
    draft are (V, V) next-token probabilities by last token. Rows get 0..k real drafts."""
    rows = torch.arange(num_rows)
    out = torch.zeros(num_rows, length + k + 1, dtype=torch.int64)
    count = torch.zeros(num_rows, dtype=torch.int64)
    last = torch.zeros(num_rows, dtype=torch.int64)
    while (count < length).any():
        draft_ids, draft_probs, prev = [], [], last
        for _ in range(k):
            q = draft[prev]  # (B, V)
            prev = q.argmax(-1) if one_hot_drafts else torch.multinomial(q, 1, generator=gen).squeeze(-1)
            draft_ids.append(prev)
            draft_probs.append(q)
        draft_ids = torch.stack(draft_ids, dim=1)  # (B, K)
        num_drafts = torch.randint(0, k + 1, (num_rows,), generator=gen)
        target_probs = target[torch.cat([last[:, None], draft_ids], dim=1)]  # (B, K+1, V)
        uniforms = torch.rand(num_rows, k + 1, generator=gen, dtype=torch.float64)
        token_ids, num_emitted = verify_sampled(draft_ids, num_drafts, target_probs,
                                                None if one_hot_drafts else torch.stack(draft_probs, 1),
                                                uniforms)
        active = count < length
        for j in range(k + 1):
            write = active & (j < num_emitted)
            out[rows[write], count[write] + j] = token_ids[write, j]
        count += torch.where(active, num_emitted, 0)
        last = torch.where(active, token_ids[rows, num_emitted - 1], last)
    return out[:, :length]


@pytest.mark.parametrize("one_hot_drafts", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_sampled_speculation_has_the_target_distribution(one_hot_drafts, k):
    gen = torch.Generator().manual_seed(10 + k)
    target = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen), dim=-1)
    draft = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen), dim=-1)
    length = 3
    tokens = speculative_sample(target, draft, one_hot_drafts, 60_000, k, length, gen)

    # Exact joint probability of every 3-token continuation of token 0 under the target.
    joint = target[0][:, None, None] * target[:, :, None] * target[None, :, :]  # (V, V, V)
    cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    counts = torch.bincount(cells, minlength=VOCAB**length)
    assert chi_square_pvalue(counts, joint.flatten()) > 1e-3
    # And it would notice sampling from the draft instead.
    wrong = draft[0][:, None, None] * draft[:, :, None] * draft[None, :, :]
    assert chi_square_pvalue(counts, wrong.flatten()) < 1e-6


def test_one_hot_targets_make_sampled_verification_greedy():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 4, 6, generator=gen)
    targets = logits.argmax(-1)
    # Drafts that agree with the target argmax for a random number of leading positions.
    draft_ids = torch.where(torch.rand(64, 3, generator=gen) < 0.7, targets[:, :3],
                            torch.randint(0, 6, (64, 3), generator=gen))
    num_drafts = torch.randint(0, 4, (64,), generator=gen)
    one_hot = torch.nn.functional.one_hot(targets, 6).float()
    uniforms = torch.rand(64, 4, generator=gen, dtype=torch.float64)
    for draft_probs in (None, torch.softmax(torch.randn(64, 3, 6, generator=gen), dim=-1)):
        tokens, n = verify_sampled(draft_ids, num_drafts, one_hot, draft_probs, uniforms)
        greedy_tokens, greedy_n = verify_greedy(draft_ids, num_drafts, logits)
        assert torch.equal(n, greedy_n)
        for row in range(64):
            assert torch.equal(tokens[row, :n[row]], greedy_tokens[row, :n[row]])


def test_identical_draft_and_target_accept_everything():
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(32, 4, 5, generator=gen), dim=-1)
    draft_ids = torch.multinomial(probs[:, :3].reshape(-1, 5), 1, generator=gen).view(32, 3)
    uniforms = torch.rand(32, 4, generator=gen, dtype=torch.float64)
    _, n = verify_sampled(draft_ids, torch.full((32,), 3), probs, probs[:, :3], uniforms)
    assert (n == 4).all()


def test_no_drafts_samples_from_the_target():
    probs = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    tokens, n = verify_sampled(torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                               probs, None, torch.full((2, 1), 0.5, dtype=torch.float64))
    assert tokens.tolist() == [[1], [2]] and n.tolist() == [1, 1]


def test_adaptive_k_grows_shrinks_and_stays_in_bounds():
    controller = AdaptiveK(k=4, k_min=2, k_max=6)
    for _ in range(10):
        controller = controller.update(controller.k, controller.k)
    assert controller.k == 6
    assert controller.update(0, 0) is controller
    for _ in range(20):
        controller = controller.update(controller.k, 0)
    assert controller.k == 2
    with pytest.raises(ValueError, match="k_min"):
        AdaptiveK(k=0, k_min=0)
