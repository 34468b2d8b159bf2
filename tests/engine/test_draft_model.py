"""Speculative decoding end to end through generate_tokens, on tiny random models: with a draft
model or prompt lookup, greedy output equals plain greedy decoding, and sampled output has the
target's distribution (chi-square over whole 3-token continuations)."""

import itertools

import pytest
import torch
from oracles import chi_square_pvalue

from edgeinfer.config import ModelConfig
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.synthetic import synthetic_model
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.draft_model import DraftModel
from edgeinfer.worker.llm import NGRAM, generate_tokens
from edgeinfer.worker.model_runner import ModelRunner
from edgeinfer.worker.sampler import SamplingBatch, sampling_probs
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool

TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position=128)


def runner(config: ModelConfig, seed: int, path: str = "reference", weights: str = "int8") -> ModelRunner:
    model = LlamaModel(config, dict(synthetic_model(config, weights, group_size=32, seed=seed).weights),
                       choose_backend(path))
    pool = KVPool(config.num_layers, 8, 16, config.num_kv_heads, config.head_dim, "fp32", "fp32")
    return ModelRunner(model, pool, 16)


class CountingRunner:
    """A runner that counts target forwards, to show drafts were accepted."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner, self.model, self.pool, self.block_size = inner, inner.model, inner.pool, inner.block_size
        self.forwards = 0

    def logits(self, chunks: list[SeqChunk]) -> torch.Tensor:
        self.forwards += 1
        return self.inner.logits(chunks)


PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 9, 40, 9, 9, 40, 9], list(range(30, 62))]


@pytest.mark.parametrize("draft_seed", [0, 5])
def test_draft_model_greedy_equals_plain_greedy(draft_seed: int) -> None:
    # Seed 0: the target's own weights on the int4 CPU path (bf16 activations) drafting for the
    # exact fp32 path, the intended pairing, most drafts accepted; seed 5: an unrelated model,
    # most rejected. Neither may change the output.
    target = CountingRunner(runner(TINY, 0, weights="int4"))
    draft = DraftModel(runner(TINY, draft_seed, "int4_cpu", "int4"))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        plain = list(generate_tokens(target, prompt, params))
        target.forwards = 0
        assert list(generate_tokens(target, prompt, params, drafter=draft)) == plain
        if draft_seed == 0:
            assert target.forwards < len(plain) * 0.6  # drafts were accepted, forwards saved


def test_ngram_greedy_equals_plain_greedy() -> None:
    target = runner(TINY, 1)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompt in PROMPTS:
        assert list(generate_tokens(target, prompt, params, drafter=NGRAM)) == list(
            generate_tokens(target, prompt, params))


def test_draft_model_with_another_vocabulary_is_refused() -> None:
    other = ModelConfig(**{**TINY.__dict__, "vocab_size": 64})
    draft = DraftModel(runner(other, 0))
    with pytest.raises(ValueError, match="vocabulary"):
        list(generate_tokens(runner(TINY, 0), [1, 2], SamplingParams(max_tokens=4), drafter=draft))


def test_unknown_drafter_is_refused() -> None:
    with pytest.raises(ValueError, match="drafter"):
        list(generate_tokens(runner(TINY, 0), [1, 2], SamplingParams(max_tokens=4), drafter="medusa"))


SMALL = ModelConfig(vocab_size=4, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, max_position=32)


def exact_distribution(target: ModelRunner, prompt: list[int], params: SamplingParams, length: int) -> torch.Tensor:
    """P(continuation) for every continuation of ``length`` tokens, from the target's own
    per-position sampling distributions."""
    vocab = SMALL.vocab_size
    table = tuple(range(target.pool.num_blocks))
    probs = torch.zeros(vocab ** length, dtype=torch.float64)
    for index, tokens in enumerate(itertools.product(range(vocab), repeat=length)):
        seq = prompt + list(tokens)
        logits = target.logits([SeqChunk(tuple(seq), 0, table, num_logits=length + 1)])[:length]
        batch = SamplingBatch.from_params([params] * length, [prompt] * length,
                                          [list(tokens[:j]) for j in range(length)], vocab, ())
        step = sampling_probs(logits, batch).double()
        probs[index] = step[torch.arange(length), torch.tensor(tokens)].prod()
    return probs


def test_draft_model_sampling_keeps_the_target_distribution() -> None:
    target = runner(SMALL, 2)
    draft = DraftModel(runner(SMALL, 3, "int4_cpu", "int4"))  # a different model: many rejections
    prompt, length, samples = [1, 3, 0], 3, 3000
    params = SamplingParams(temperature=1.5, max_tokens=length, ignore_eos=True)
    want = exact_distribution(target, prompt, params, length)
    counts = torch.zeros_like(want)
    for seed in range(samples):
        tokens = list(generate_tokens(target, prompt, SamplingParams(**{**params.__dict__, "seed": seed}),
                                      drafter=draft))
        counts[sum(t * SMALL.vocab_size ** (length - 1 - j) for j, t in enumerate(tokens))] += 1
    assert want.max() < 0.5  # a spread distribution, so the test can tell
    assert chi_square_pvalue(counts, want) > 1e-3
