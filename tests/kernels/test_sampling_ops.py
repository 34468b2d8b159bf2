"""The C++ token-choice ops (kernels/cpu/sampling.cpp): row_topk against torch.topk and a sort,
sample_rows against the textbook distribution (tests/oracles.reference_probs) drawn by inverse
CDF in float64.

Vocabularies that are not multiples of the ops' 8-value vectors or 64-token blocks; rows flat
and peaked (nuclei of a few tokens and of thousands), with masked (-inf) tokens; top-k on both
sides of the heap's bound (128). Skipped where the ops do not build.
"""

import pytest
import torch
from oracles import reference_probs

from kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the AVX2 CPU ops do not build here")


def _rows(vocab: int, scales: list[float], seed: int, masked: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.stack([torch.randn(vocab, generator=gen) * s + 1.5 for s in scales])
    if masked:
        x[:, torch.randperm(vocab, generator=gen)[:masked]] = -torch.inf
    return x


@pytest.mark.parametrize(("vocab", "k"), [(v, k) for v in (7, 1001, 49157) for k in (0, 1, 5, 7, 64, 128, 129, 700)
                                           if k <= v])
def test_row_topk_matches_torch(vocab, k):
    x = _rows(vocab, [0.5, 3.0, 8.0], seed=vocab + k, masked=vocab // 10)
    values, indices = cpu_ops.row_topk(x, k)
    want_values, want_indices = x.topk(k, dim=-1)
    assert torch.equal(values, want_values)
    finite = torch.isfinite(want_values)  # masked tokens tie at -inf: any order of them will do
    assert torch.equal(indices[finite], want_indices[finite])
    assert torch.equal(x.gather(-1, indices), values)


def test_row_topk_ties_go_to_the_lower_index_and_nan_ranks_first():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 2.0, 3.0, 1.0, 2.0]])
    values, indices = cpu_ops.row_topk(x, 6)
    # A sort by (value descending, index ascending): the oracle.
    order = sorted(range(x.shape[1]), key=lambda i: (-x[0, i].item(), i))[:6]
    assert indices[0].tolist() == order
    x[0, 6] = torch.nan
    values, indices = cpu_ops.row_topk(x, 3)
    assert indices[0].tolist() == [6, 1, 2] and values[0, 0].isnan()
    with pytest.raises(RuntimeError, match="k must be in"):
        cpu_ops.row_topk(x, 11)


@pytest.mark.parametrize("k", [16, 64, 90])
def test_row_topk_of_long_rows_ties_masks_and_nans(k):
    # Rows of 49157 (192 blocks of 256 and 5 more) and k up to 96 take the bound of the blocks'
    # maxima; a row mostly -inf ties too many values at the bound and takes the heap; a NaN
    # anywhere, in a block or past the last, ranks first.
    gen = torch.Generator().manual_seed(k)
    vocab = 49157
    ties = (torch.randn(vocab, generator=gen) * 2).round()  # ~15 distinct values: ties at the k-th
    masked = torch.full((vocab,), -torch.inf)
    masked[torch.randperm(vocab, generator=gen)[:200]] = torch.randn(200, generator=gen)
    peaked = torch.randn(vocab, generator=gen)
    peaked[torch.randperm(vocab, generator=gen)[:30]] += 20.0
    peaked[-1] = 50.0  # the best past the last whole block
    x = torch.stack([ties, masked, peaked])
    values, indices = cpu_ops.row_topk(x, k)
    for row in range(x.shape[0]):  # a sort by (value descending, index ascending): the oracle
        r = x[row].tolist()
        order = sorted(range(vocab), key=lambda i, r=r: (-r[i], i))[:k]
        assert indices[row].tolist() == order and torch.equal(values[row], x[row, order])
    for at in (1000, vocab - 2):
        nan_row = peaked.clone()
        nan_row[at] = torch.nan
        values, indices = cpu_ops.row_topk(nan_row[None], k)
        r = nan_row.tolist()
        rest = sorted((i for i in range(vocab) if i != at), key=lambda i, r=r: (-r[i], i))[:k - 1]
        assert indices[0].tolist() == [at, *rest] and values[0, 0].isnan()


def _oracle_token(probs: torch.Tensor, u: float) -> tuple[int, float]:
    """Inverse CDF in vocabulary order: the first token whose cumulative probability exceeds u,
    and how far u lies from the nearest CDF step (a draw closer than rounding is not checked)."""
    cdf = probs.cumsum(0)
    token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True).clamp(max=len(probs) - 1))
    steps = cdf[probs > 0]
    return token, float((steps - u).abs().min())


SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 0, 1.0, 0.1),
    (0.8, 0, 0.95, 0.0),
    (1.0, 0, 0.5, 0.0),
    (1.5, 0, 0.999, 0.0),
    (0.7, 40, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (0.9, 40, 0.9, 0.05),
    (1.2, 300, 0.8, 0.0),
    (1.0, 300, 1.0, 0.02),
]


@pytest.mark.parametrize("vocab", [13, 3001])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "t{}-k{}-p{}-m{}".format(*s))
def test_sample_rows_draws_the_oracle_token(vocab, setting):
    temperature, top_k, top_p, min_p = setting
    scales = [0.3, 1.0, 3.0, 8.0]
    x = _rows(vocab, scales, seed=vocab, masked=vocab // 7)
    uniforms = torch.linspace(0.003, 0.997, 61, dtype=torch.float64)
    rows = x.repeat_interleave(len(uniforms), dim=0)
    n = rows.shape[0]
    top_k_row = top_k if 0 < top_k < vocab else vocab
    tokens = cpu_ops.sample_rows(
        rows, torch.full((n,), temperature), torch.zeros(n, dtype=torch.bool), torch.full((n,), top_k_row),
        torch.full((n,), top_p), torch.full((n,), torch.log(torch.tensor(min_p)).item()),
        uniforms.repeat(len(scales)))
    checked = 0
    for r, scale in enumerate(scales):
        probs = reference_probs(x[r], temperature, top_k, top_p, min_p)
        for j, u in enumerate(uniforms.tolist()):
            want, margin = _oracle_token(probs, u)
            if margin < 1e-6:
                continue
            checked += 1
            got = int(tokens[r * len(uniforms) + j])
            assert got == want, (scale, u, got, want)
    assert checked > 0.9 * n


def test_greedy_rows_take_the_first_largest_and_mixed_rows_draw_their_own():
    x = _rows(1001, [1.0, 2.0, 1.0], seed=3)
    x[0, 10] = x[0, 900] = x[0].max() + 1  # a tie: the lower index
    greedy = torch.tensor([True, False, True])
    tokens = cpu_ops.sample_rows(x, torch.tensor([1.0, 0.9, 1.0]), greedy, torch.tensor([1001, 5, 1001]),
                                 torch.tensor([1.0, 1.0, 1.0]), torch.full((3,), -torch.inf),
                                 torch.tensor([0.5, 0.42, 0.5], dtype=torch.float64))
    assert int(tokens[0]) == 10 and int(tokens[2]) == int(x[2].argmax())
    want, _ = _oracle_token(reference_probs(x[1], 0.9, 5), 0.42)
    assert int(tokens[1]) == want


def test_sample_rows_refuses_nan_and_fully_masked_rows_by_row():
    def draw(x):
        n = x.shape[0]
        return cpu_ops.sample_rows(x, torch.ones(n), torch.zeros(n, dtype=torch.bool), torch.full((n,), x.shape[1]),
                                   torch.ones(n), torch.full((n,), -torch.inf),
                                   torch.full((n,), 0.5, dtype=torch.float64))

    x = _rows(100, [1.0, 1.0], seed=4)
    x[1, 37] = torch.nan
    with pytest.raises(RuntimeError, match="row 1 of the logits holds a NaN"):
        draw(x)
    x[1] = -torch.inf
    with pytest.raises(RuntimeError, match="row 1 has every token at -inf"):
        draw(x)
