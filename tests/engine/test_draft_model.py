"""Draft-model speculative decoding through the scheduler and the model actor, on tiny random
models: greedy streams drafting side by side give each the tokens it gives alone without
speculation (drafts accepted and rejected, prompts chunked, preemption), and sampled output keeps
the target's distribution (chi-square over whole 3-token continuations, enumerated exactly)."""

import itertools

import pytest
import torch
from fake_runner import run_requests
from oracles import chi_square_pvalue

from edgeinfer.config import ModelConfig, SchedulerConfig
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.engine.api import EngineConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.synthetic import synthetic_model
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.kv_pools import kv_pool
from edgeinfer.worker.model_runner import ModelRunner
from edgeinfer.worker.sampler import SamplingBatch, sampling_probs
from kernels.dispatch import choose_backend

TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position=128)
SMALL = ModelConfig(vocab_size=4, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, max_position=32)
BLOCK = 4  # small blocks: drafts cross block boundaries, copy-on-write and preemption happen


def runner(config: ModelConfig, seed: int, num_blocks: int, path: str = "reference",
           weights: str = "int8") -> ModelRunner:
    model = LlamaModel(config, dict(synthetic_model(config, weights, group_size=32, seed=seed).weights),
                       choose_backend(path))
    return ModelRunner(model, kv_pool(config, num_blocks, BLOCK, "fp32", "fp32"), BLOCK)


class Counting(ModelRunner):
    """The target's runner, counting its forwards (fewer than tokens: drafts were accepted)."""

    def __init__(self, inner: ModelRunner) -> None:
        self.__dict__.update(inner.__dict__)
        self.forwards = 0

    def logits(self, chunks: list[SeqChunk]) -> torch.Tensor:
        self.forwards += 1
        return super().logits(chunks)


PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 9, 40, 9, 9, 40, 9], list(range(30, 62)), [5, 6] * 9, [80, 3, 17],
           list(range(60, 10, -3)), [11] * 12]


@pytest.mark.parametrize(("draft_seed", "speculate_max_seqs"), [(0, 8), (5, 8), (0, 3)])
def test_eight_greedy_streams_with_a_draft_model_each_get_their_tokens_alone(draft_seed: int,
                                                                            speculate_max_seqs: int) -> None:
    # Seed 0: the target's own weights on the int4 CPU path (bf16 activations) drafting for the
    # exact fp32 path, the intended pairing, most drafts accepted; seed 5: an unrelated model,
    # most rejected. Neither may change any stream's output. With speculate_max_seqs 3 nobody
    # drafts until streams finish, then the draft model catches up on what it missed.
    params = [SamplingParams(temperature=0, max_tokens=24 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    target = Counting(runner(TINY, 0, 160, weights="int4"))
    alone = {str(i): run_requests(target, [p], [params[i]])["0"] for i, p in enumerate(PROMPTS)}
    target.forwards = 0
    draft = runner(TINY, draft_seed, 160, "int4_cpu", "int4")
    assert run_requests(target, PROMPTS, params, draft, speculate_max_seqs=speculate_max_seqs) == alone
    if draft_seed == 0 and speculate_max_seqs == 8:  # alone-decoding the longest stream takes max_tokens forwards
        assert target.forwards < max(p.max_tokens for p in params) * 0.7


def test_draft_model_survives_preemption_and_a_small_pool() -> None:
    # 40 blocks of 4 tokens cannot hold 8 streams of ~60 tokens: sequences are preempted,
    # recomputed (the draft pool refilled from position 0) and still give their tokens alone.
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(PROMPTS)
    alone = {str(i): run_requests(runner(TINY, 0, 40), [p], [params[i]])["0"] for i, p in enumerate(PROMPTS)}
    assert run_requests(runner(TINY, 0, 40), PROMPTS, params, runner(TINY, 0, 40, "int4_cpu", "int4")) == alone


def test_a_draft_model_needs_speculative_draft_and_the_same_vocabulary() -> None:
    with pytest.raises(ValueError, match="draft"):
        EngineConfig("m.gguf", draft_model_path="d.gguf")
    with pytest.raises(ValueError, match="draft"):
        EngineConfig("m.gguf", scheduler=SchedulerConfig(speculative="draft"))


def exact_distribution(target: ModelRunner, prompt: list[int], params: SamplingParams, length: int) -> torch.Tensor:
    """P(continuation) for every continuation of ``length`` tokens, from the target's own
    per-position sampling distributions over the whole sequence in one forward."""
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
    # 3000 seeded requests, 64 at a time, all drafting: the chance that a correct implementation
    # fails the p > 1e-3 bound is 1e-3 per run (seeds are fixed, so a given build either passes
    # or fails every time).
    prompt, length, samples = [1, 3, 0], 3, 3000
    params = SamplingParams(temperature=1.5, max_tokens=length, ignore_eos=True)
    target = runner(SMALL, 2, 64 * 2)
    draft = runner(SMALL, 3, 64 * 2, "int4_cpu", "int4")  # a different model: many rejections
    want = exact_distribution(runner(SMALL, 2, 2), prompt, params, length)
    counts = torch.zeros_like(want)
    for first in range(0, samples, 64):
        seeded = [SamplingParams(**{**params.__dict__, "seed": seed}) for seed in range(first, first + 64)]
        for tokens in run_requests(target, [prompt] * 64, seeded, draft, max_num_seqs=64, max_num_batched_tokens=512,
                            speculate_max_seqs=64).values():
            counts[sum(t * SMALL.vocab_size ** (length - 1 - j) for j, t in enumerate(tokens))] += 1
    assert want.max() < 0.5  # a spread distribution, so the test can tell
    assert chi_square_pvalue(counts, want) > 1e-3
