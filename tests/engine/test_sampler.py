"""Sampler: sampled frequencies match the truncated distribution (chi-square), penalty
arithmetic, seeds independent of batch neighbours, greedy, min_tokens, logprobs."""

import dataclasses
import math

import fake_runner
import pytest
import torch
from oracles import reference_probs

from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.worker import sampler
from edgeinfer.worker.sampler import (
    SamplingBatch,
    processed_logits,
    sample,
    sampling_probs,
    seeded_uniform,
    takes_argmax,
)
from kernels import cpu_ops

VOCAB = 12
NUM_SAMPLES = 40_000


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs; also asserts nothing fell outside the support."""
    counts, probs = counts.double(), probs.double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the truncation removed"
    expected = probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = torch.tensor(float(support.sum() - 1))
    return torch.special.gammaincc(df / 2, stat / 2).item()  # chi2 survival function


def sample_many(logits: torch.Tensor, params: SamplingParams, seeded: bool = False) -> torch.Tensor:
    """Token counts from NUM_SAMPLES rows of the same logits, sampled in one batch."""
    if seeded:
        rows = [dataclasses.replace(params, seed=i) for i in range(NUM_SAMPLES)]
    else:
        rows = [params] * NUM_SAMPLES
    batch = SamplingBatch.from_params(rows, [[]] * NUM_SAMPLES, [[]] * NUM_SAMPLES, VOCAB,
                                      generator=torch.Generator().manual_seed(0))
    tokens = sample(logits.expand(NUM_SAMPLES, -1), batch).token_ids
    return torch.bincount(tokens, minlength=VOCAB)


LOGITS = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 1.5


@pytest.fixture(params=["cpu_ops", "torch"])
def path(request, monkeypatch):
    """Both ways `sample` chooses tokens: the C++ ops (CPU logits, where they build) and the torch
    path (their reference; CUDA's)."""
    if request.param == "cpu_ops" and not cpu_ops.available():
        pytest.skip("the C++ CPU ops do not build here")
    if request.param == "torch":
        monkeypatch.setattr(sampler, "_cpu_kernels", lambda logits: False)
    return request.param


@pytest.mark.parametrize("kwargs", [
    {},
    {"temperature": 0.6},
    {"temperature": 1.7},
    {"top_k": 4},
    {"top_p": 0.7},
    {"top_p": 0.95, "temperature": 0.8},
    {"min_p": 0.1},
    {"top_k": 6, "top_p": 0.8, "min_p": 0.05, "temperature": 1.3},
])
def test_frequencies_match_truncated_distribution(kwargs, path):
    expected = reference_probs(LOGITS, **kwargs)
    counts = sample_many(LOGITS, SamplingParams(**kwargs))
    assert chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.parametrize("kwargs", [{}, {"top_k": 6, "top_p": 0.8, "min_p": 0.05, "temperature": 1.3}])
def test_seeded_rows_have_the_same_distribution(kwargs, path):
    """Seeds 0..N-1 draw their uniforms from seeded_uniform: they must be as uniform as torch's."""
    expected = reference_probs(LOGITS, **kwargs)
    counts = sample_many(LOGITS, SamplingParams(**kwargs), seeded=True)
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_truncation_removes_what_it_should():
    probs = sampling_probs(LOGITS.expand(1, -1), SamplingBatch.from_params(
        [SamplingParams(top_k=3)], [[]], [[]], VOCAB))
    assert int((probs > 0).sum()) == 3
    assert torch.allclose(probs[0].double(), reference_probs(LOGITS, top_k=3), atol=1e-6)


def test_penalties_match_direct_formula():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    prompts = [[1, 2, 2], [], [5]]
    outputs = [[2, 3, 3, 3], [4, 4, 7], []]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, logit_bias={0: 5.0, 4: -2.0}),
              SamplingParams(repetition_penalty=2.0)]
    batch = SamplingBatch.from_params(params, prompts, outputs, VOCAB)
    got = processed_logits(logits, batch)
    for row, p in enumerate(params):
        for token in range(VOCAB):
            x = logits[row, token].item()
            count = outputs[row].count(token)
            if token in prompts[row] or count:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
            x += dict(p.logit_bias).get(token, 0.0)
            assert got[row, token].item() == pytest.approx(x, rel=1e-5, abs=1e-5)


def test_penalties_change_nothing_when_off():
    logits = torch.randn(2, VOCAB)
    batch = SamplingBatch.from_params([SamplingParams()] * 2, [[1, 2], [3]], [[4], [5, 5]], VOCAB)
    assert batch.penalty_rows is None
    assert torch.equal(processed_logits(logits, batch), logits)


def test_seed_gives_same_tokens_whatever_the_neighbours(path):
    gen = torch.Generator().manual_seed(3)
    target = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    for step in range(20):
        row = torch.randn(VOCAB, generator=gen)
        output_ids = [0] * step
        alone = sample(row[None], SamplingBatch.from_params([target], [[1]], [output_ids], VOCAB))
        neighbours = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=7, top_k=2)]
        logits = torch.stack([torch.randn(VOCAB, generator=gen), row, torch.randn(VOCAB, generator=gen),
                              torch.randn(VOCAB, generator=gen)])
        batch = SamplingBatch.from_params([neighbours[0], target, *neighbours[1:]], [[1]] * 4,
                                          [[0], output_ids, [], [3, 3]], VOCAB)
        assert sample(logits, batch).token_ids[1] == alone.token_ids[0]


def test_seeded_uniform_separates_seeds_choices_and_steps():
    values = {seeded_uniform(seed, choice, step) for seed in range(5) for choice in range(3)
              for step in range(5)}
    assert len(values) == 75 and all(0 < u < 1 for u in values)
    assert seeded_uniform(9, 1, 2) == seeded_uniform(9, 1, 2)


def test_greedy_rows_take_argmax_of_processed_logits(path):
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    params = SamplingParams(temperature=0, frequency_penalty=1.0, top_k=1)
    batch = SamplingBatch.from_params([params], [[]], [[1]], 4)
    assert sample(logits, batch).token_ids.tolist() == [2]  # token 1's count pushed it to 2.0
    assert sampling_probs(logits, batch).tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_takes_argmax_exactly_where_sample_keeps_the_raw_argmax(path):
    """The model actor's plain greedy steps skip the sampler for rows `takes_argmax` names: on logits
    where every one of steps 1-4 moves the answer, it must name exactly the rows whose sampled
    token is still the raw argmax (and never a row that asks for logprobs or draws)."""
    eos = 0
    logits = torch.rand(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2 - 1
    logits[0, eos], logits[0, 1] = 5.0, 4.9  # the argmax, and a close second that any change promotes
    all_but_eos = (0xFFF & ~1).to_bytes(4, "little")  # one 32-bit word: bit t allows token t
    cases = [  # (params, prompt, output, guide mask)
        (SamplingParams(temperature=0), [], [], b""),
        (SamplingParams(temperature=0, min_tokens=3), [], [4], b""),
        (SamplingParams(temperature=0, min_tokens=3), [], [4, 5, 6], b""),
        (SamplingParams(temperature=0, repetition_penalty=2.0), [eos], [], b""),
        (SamplingParams(temperature=0, presence_penalty=1.0), [], [eos], b""),
        (SamplingParams(temperature=0, frequency_penalty=0.5), [], [eos], b""),
        (SamplingParams(temperature=0, logit_bias={1: 0.5}), [], [], b""),
        (SamplingParams(temperature=0), [], [], all_but_eos),
    ]
    for params, prompt, output, guide in cases:
        batch = SamplingBatch.from_params([params], [prompt], [output], VOCAB, eos_token_ids=(eos,),
                                          guide_masks=[guide])
        keeps_argmax = sample(logits, batch).token_ids.item() == eos
        assert takes_argmax(params, len(output), bool(guide)) == keeps_argmax, params
    assert takes_argmax(SamplingParams(temperature=0), 0, False)
    assert not takes_argmax(SamplingParams(temperature=0, logprobs=0), 0, False)
    assert not takes_argmax(SamplingParams(temperature=0.8, top_k=1), 0, False)


def test_a_plain_greedy_step_takes_the_first_of_tied_maxima_beside_a_row_that_needs_the_sampler():
    """Through the model actor: a plain greedy request's tokens skip the sampler, a request with
    min_tokens pending goes through it in the same steps; the oracle is torch.argmax on the row
    (EOS masked by hand while min_tokens is pending), which takes the first of tied maxima."""
    def logits_fn(context: list[int]) -> torch.Tensor:
        row = torch.zeros(fake_runner.VOCAB)
        row[3] = row[7] = 2.0  # tied
        row[fake_runner.EOS] = 3.0
        return row

    sched, actor = fake_runner.make(logits_fn=logits_fn)
    sched.add_request("plain", [5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    sched.add_request("pending", [5, 9], SamplingParams(temperature=0, max_tokens=3, min_tokens=2))
    events = fake_runner.run_all(sched, actor)
    row = logits_fn([])
    masked = row.clone()
    masked[fake_runner.EOS] = -math.inf
    first, suppressed = int(torch.argmax(row)), int(torch.argmax(masked))
    assert fake_runner.tokens_of(events["plain"]) == [first] * 3
    assert fake_runner.tokens_of(events["pending"]) == [suppressed, suppressed, first]
    assert suppressed == 3


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 0.5}, {"presence_penalty": 0.3},
                                     {"repetition_penalty": 1.5}])
def test_penalties_through_the_model_actor_read_the_tokens_so_far(penalty: dict) -> None:
    """A penalised request's tokens through the scheduler and the model actor (which sends a
    decode row its output only when a penalty reads it) equal a loop that applies the penalty's
    formula to the same logits by hand, each step over the prompt and the output so far."""
    base = torch.zeros(fake_runner.VOCAB)
    base[3], base[7], base[9] = 2.0, 1.9, 1.7

    def oracle(prompt: list[int], steps: int) -> list[int]:
        out: list[int] = []
        for _ in range(steps):
            row = base.clone()
            for t in set(prompt) | set(out):
                count = out.count(t)
                if "repetition_penalty" in penalty:
                    r = penalty["repetition_penalty"]
                    row[t] = row[t] / r if row[t] > 0 else row[t] * r
                row[t] -= count * penalty.get("frequency_penalty", 0.0)
                row[t] -= (count > 0) * penalty.get("presence_penalty", 0.0)
            out.append(int(torch.argmax(row)))
        return out

    sched, actor = fake_runner.make(logits_fn=lambda context: base.clone())
    prompt = [3, 5]
    sched.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **penalty))
    tokens = fake_runner.tokens_of(fake_runner.run_all(sched, actor)["r"])
    expected = oracle(prompt, 6)
    assert tokens == expected and len(set(expected)) > 1  # the penalty moved the choice


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 50.0, 50.0]])  # 2 is EOS, 3 a stop token id
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    for num_out, allowed in [(0, False), (1, False), (2, True)]:
        batch = SamplingBatch.from_params([params], [[]], [[0] * num_out], 4, eos_token_ids=[2])
        token = sample(logits, batch).token_ids.item()
        assert (token in (2, 3)) == allowed


def test_logit_bias_can_force_a_token():
    batch = SamplingBatch.from_params([SamplingParams(logit_bias={5: 100})] * 100, [[]] * 100,
                                      [[]] * 100, VOCAB)
    assert (sample(torch.randn(100, VOCAB), batch).token_ids == 5).all()


def test_logprobs_are_post_penalty_pre_temperature(path):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(logprobs=3, temperature=0.5, top_k=2, presence_penalty=1.0),
              SamplingParams(),
              SamplingParams(logprobs=0, temperature=0)]
    batch = SamplingBatch.from_params(params, [[]] * 3, [[1, 2], [], []], VOCAB)
    out = sample(logits, batch)
    reference = torch.log_softmax(processed_logits(logits, batch), dim=-1)
    assert torch.allclose(out.logprobs, reference.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert out.top_ids.shape == (3, 3)
    assert torch.allclose(out.top_logprobs, reference.topk(3).values)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert math.isfinite(out.top_logprobs[0, 2].item())  # outside top-k, still reported


def test_logprobs_zero_reports_the_chosen_token_alone(path):
    batch = SamplingBatch.from_params([SamplingParams(logprobs=0)] * 2, [[]] * 2, [[]] * 2, VOCAB)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(7))
    out = sample(logits, batch)
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs, chosen)


def test_no_logprobs_when_none_asked():
    batch = SamplingBatch.from_params([SamplingParams()], [[]], [[]], VOCAB)
    out = sample(torch.randn(1, VOCAB), batch)
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_truncation_matches_reference_on_a_large_vocabulary():
    """Beyond _MIN_CANDIDATES tokens: the partial sort, its fall-back to a full sort for a wide
    nucleus, a top_k above the candidate count, and an untruncated row beside truncated ones."""
    vocab = 3000
    gen = torch.Generator().manual_seed(5)
    scales = [4.0, 0.1, 1.0, 1.0, 2.0]
    logits = torch.stack([torch.randn(vocab, generator=gen) * s for s in scales])
    kwargs = [{"top_p": 0.9}, {"top_p": 0.99}, {"top_k": 600}, {},
              {"top_k": 5, "top_p": 0.5, "temperature": 0.7}]
    for rows in ([0, 2, 3, 4], [1, 3]):  # without, then with a nucleus wider than the candidates
        params = [SamplingParams(**kwargs[r]) for r in rows]
        batch = SamplingBatch.from_params(params, [[]] * len(rows), [[]] * len(rows), vocab)
        probs = sampling_probs(logits[rows], batch)
        for i, row in enumerate(rows):
            expected = reference_probs(logits[row], **kwargs[row])
            assert torch.equal(probs[i] > 0, expected > 0), kwargs[row]
            assert torch.allclose(probs[i].double(), expected, atol=1e-6), kwargs[row]


def pack_mask(allowed: list[bool]) -> bytes:
    """SeqStep.guide_masks' format, by plain integer arithmetic: bit t % 32 of word t // 32."""
    words = [0] * ((len(allowed) + 31) // 32)
    for t, ok in enumerate(allowed):
        words[t // 32] |= int(ok) << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_guide_masks_match_the_grammar_library_and_leave_other_rows_alone():
    llg_numpy = pytest.importorskip("llguidance.numpy")
    np = pytest.importorskip("numpy")
    vocab, gen = 70, torch.Generator().manual_seed(5)  # 70: the last mask word is partly used
    logits = torch.randn(5, vocab, generator=gen) * 2
    allowed = torch.rand(5, vocab, generator=gen) < 0.3
    masks = [pack_mask(allowed[i].tolist()) if i in (0, 2, 3) else b"" for i in range(5)]
    params = [SamplingParams(temperature=0.8, seed=i, logit_bias={1: 2.0}) for i in range(5)]
    guided = SamplingBatch.from_params(params, [[]] * 5, [[]] * 5, vocab, guide_masks=masks)
    plain = SamplingBatch.from_params(params, [[]] * 5, [[]] * 5, vocab)
    expected = processed_logits(logits, plain).numpy().copy()
    words = np.stack([np.frombuffer(masks[i], dtype=np.int32) for i in (0, 2, 3)])
    rows = expected[[0, 2, 3]]
    llg_numpy.apply_token_bitmask_inplace(rows, words)
    expected[[0, 2, 3]] = rows
    assert torch.equal(processed_logits(logits, guided), torch.from_numpy(expected))
    out, alone = sample(logits, guided).token_ids, sample(logits, plain).token_ids
    assert out[[1, 4]].tolist() == alone[[1, 4]].tolist()  # seeded rows without a mask: unchanged


def test_the_ops_draw_the_reference_paths_tokens(monkeypatch):
    """The same uniforms through the C++ ops and the torch path, rows of a wide vocabulary flat to
    peaked: the same tokens but where a uniform lands within float rounding of a step of the CDF."""
    if not cpu_ops.available():
        pytest.skip("the C++ CPU ops do not build here")
    vocab, gen = 5003, torch.Generator().manual_seed(6)
    settings = [{}, {"temperature": 0.7, "top_p": 0.9}, {"top_k": 40}, {"top_k": 300, "top_p": 0.8, "min_p": 0.02},
                {"temperature": 1.4, "top_p": 0.99}, {"temperature": 0}]
    params = [SamplingParams(**kw) for kw in settings for _ in range(20)]
    logits = torch.randn(len(params), vocab, generator=gen) * torch.linspace(0.3, 8, len(params))[:, None]
    batch = SamplingBatch.from_params(params, [[]] * len(params), [[]] * len(params), vocab, generator=gen)
    ours = sample(logits, batch).token_ids
    monkeypatch.setattr(sampler, "_cpu_kernels", lambda logits: False)
    theirs = sample(logits, batch).token_ids
    differ = (ours != theirs).nonzero().flatten().tolist()
    for row in differ:  # only at a CDF step: u within rounding of the cumulative mass before a token
        probs = sampling_probs(logits[row:row + 1], dataclasses.replace(
            batch, **{f: getattr(batch, f)[row:row + 1] for f in ("temperature", "greedy", "top_k", "top_p",
                                                                  "log_min_p", "uniforms")}))[0].double()
        cdf = probs.cumsum(0) / probs.sum()
        assert (cdf - batch.uniforms[row]).abs().min() < 1e-5, (row, int(ours[row]), int(theirs[row]))
    assert len(differ) <= 2


def test_masked_rows_never_pick_a_disallowed_token_and_keep_the_masked_distribution():
    gen = torch.Generator().manual_seed(6)
    allowed = torch.rand(VOCAB, generator=gen) < 0.5
    allowed[LOGITS.argmax()] = False  # the favourite is refused
    params = SamplingParams(temperature=1.3, top_p=0.9)
    batch = SamplingBatch.from_params([params] * NUM_SAMPLES, [[]] * NUM_SAMPLES, [[]] * NUM_SAMPLES, VOCAB,
                                      generator=gen, guide_masks=[pack_mask(allowed.tolist())] * NUM_SAMPLES)
    tokens = sample(LOGITS.expand(NUM_SAMPLES, -1), batch).token_ids
    assert allowed[tokens].all()
    masked = LOGITS.masked_fill(~allowed, -math.inf)
    counts = torch.bincount(tokens, minlength=VOCAB)
    assert chi_square_pvalue(counts, reference_probs(masked, temperature=1.3, top_p=0.9)) > 1e-3
