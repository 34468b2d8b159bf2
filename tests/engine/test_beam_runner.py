"""Beam search on a real (tiny, random) model: the KV-caching, block-forking step function gives
the same hypotheses as recomputing every beam from scratch, shares blocks between beams, and
leaves the pool empty afterwards."""

import pytest
import torch

from edgeinfer.config import ModelConfig
from edgeinfer.core.beam_search import BeamSearchParams, BeamState, beam_search
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.synthetic import synthetic_model
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.beam_runner import BeamStepper, beam_pool_blocks, beam_search_tokens
from edgeinfer.worker.model_runner import ModelRunner
from kernels.kv_pool import KVPool

TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position=128)
BLOCK = 4  # small blocks: beams cross block boundaries and copy-on-write often
EOS = 3


def make_runner(num_blocks: int, kv_dtype: str = "fp32") -> ModelRunner:
    model = LlamaModel(TINY, dict(synthetic_model(TINY, "int4", group_size=32, seed=7).weights),
                       linear_path="reference")
    pool = KVPool(TINY.num_layers, num_blocks, BLOCK, TINY.num_kv_heads, TINY.head_dim, kv_dtype, kv_dtype)
    return ModelRunner(model, pool, BLOCK)


def uncached_step_fn(runner: ModelRunner):
    """Every prefix computed from scratch in its own blocks: the oracle for the cached stepper."""
    def step(prefixes: list[list[int]]) -> torch.Tensor:
        rows = []
        for prefix in prefixes:
            table = tuple(range(-(-len(prefix) // BLOCK)))
            rows.append(runner.logits([SeqChunk(tuple(prefix), 0, table)])[0])
        return [list(enumerate(row)) for row in torch.log_softmax(torch.stack(rows), dim=-1).tolist()]
    return step


@pytest.mark.parametrize("width, max_tokens, early_stopping", [(1, 9, False), (3, 11, False), (4, 10, "never")])
@pytest.mark.parametrize("prompt", [[5, 9, 17], list(range(10, 23))])
def test_cached_beam_search_equals_uncached(width, max_tokens, early_stopping, prompt) -> None:
    params = BeamSearchParams(width=width, max_tokens=max_tokens, num_results=width, length_penalty=1.0,
                              early_stopping=early_stopping, eos_token_ids=(EOS,))
    runner = make_runner(beam_pool_blocks(len(prompt), params, BLOCK))
    got = beam_search_tokens(runner, prompt, params)
    want = beam_search(prompt, uncached_step_fn(make_runner(64)), params)
    assert [h.token_ids for h in got] == [h.token_ids for h in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert g.finish_reason == w.finish_reason


def test_beams_share_blocks_and_free_them() -> None:
    prompt = list(range(10, 30))  # 5 full blocks
    params = BeamSearchParams(width=4, max_tokens=6, num_results=4)
    runner = make_runner(beam_pool_blocks(len(prompt), params, BLOCK))
    stepper = BeamStepper(runner, BeamState(params).num_candidates)
    peak = 0

    def step(prefixes: list[list[int]]) -> list[list[tuple[int, float]]]:
        nonlocal peak
        out = stepper.step(prefixes)
        stepper.blocks.check_invariants()
        peak = max(peak, stepper.blocks.num_used)
        return out

    hyps = beam_search(prompt, step, params)
    assert len(hyps) == 4 and len({h.token_ids for h in hyps}) == 4
    unshared = 4 * -(-(len(prompt) + params.max_tokens) // BLOCK)
    assert peak <= 5 + 4 * 3 < unshared  # the prompt's 5 blocks held once, not once per beam
    stepper.close()
    assert stepper.blocks.num_used == 0


def test_too_small_a_pool_is_a_clear_error() -> None:
    params = BeamSearchParams(width=4, max_tokens=20)
    with pytest.raises(ValueError, match="needs .* KV blocks"):
        beam_search_tokens(make_runner(4), [1, 2, 3], params)
