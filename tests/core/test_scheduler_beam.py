"""Beam search inside the scheduler and model actor (fake model, tiny pools): the results equal
the reference beam search over the same model, beams share and copy blocks correctly (the fake
model reads every context back through the block tables), under preemption too, and an abort
frees everything."""

from __future__ import annotations

import pytest
import torch
from fake_runner import EOS, VOCAB, make, run_all, step

from edgeinfer.core.beam_search import BeamSearchParams, beam_search
from edgeinfer.core.events import Finished, Token
from edgeinfer.core.sampling_params import InvalidParams, SamplingParams


def spread_logits(context: list[int]) -> torch.Tensor:
    """Distinct logits that depend on the whole context (no ties for the beams to break)."""
    seed = sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def reference(prompt: list[int], params: SamplingParams):
    search = BeamSearchParams(params.beam_width, params.max_tokens, params.n, params.length_penalty,
                              params.early_stopping, eos_token_ids=(EOS,))
    return beam_search(prompt, lambda prefixes: [list(enumerate(torch.log_softmax(spread_logits(p), dim=-1).tolist()))
                                                 for p in prefixes], search)


def check(events: list, prompt: list[int], params: SamplingParams) -> None:
    want = reference(prompt, params)
    tokens = [e for e in events if isinstance(e, Token)]
    assert [e.index for e in tokens] == list(range(len(want)))
    assert [e.token_ids for e in tokens] == [h.token_ids for h in want]
    done = events[-1]
    assert isinstance(done, Finished) and sum(isinstance(e, Finished) for e in events) == 1
    assert [c["score"] for c in done.choices] == pytest.approx([h.score for h in want], abs=1e-4)
    assert done.finish_reason == want[0].finish_reason


@pytest.mark.parametrize("width, n, max_tokens, length_penalty, early", [
    (1, 1, 6, 1.0, False), (3, 2, 9, 1.0, False), (4, 4, 7, 0.5, "never"), (3, 3, 12, 2.0, True)])
def test_beam_search_equals_the_reference(width: int, n: int, max_tokens: int, length_penalty: float,
                                          early: bool | str) -> None:
    sched, model = make(num_blocks=48, logits_fn=spread_logits, max_num_seqs=8, max_num_batched_tokens=32)
    prompt = [5, 9, 2, 11, 3, 7]  # ends inside a block: beams copy it on their first append
    params = SamplingParams(beam_width=width, n=n, max_tokens=max_tokens, length_penalty=length_penalty,
                            early_stopping=early)
    sched.add_request("b", prompt, params)
    check(run_all(sched, model)["b"], prompt, params)
    assert sched.block_manager.num_used == 0 and not sched.running and not sched.waiting


def greedy(prompt: list[int], n: int) -> list[int]:
    context = list(prompt)
    for _ in range(n):
        context.append(int(spread_logits(context).argmax()))
    return context[len(prompt):]


def test_beam_search_beside_sampling_under_preemption() -> None:
    sched, model = make(num_blocks=14, logits_fn=spread_logits, max_num_seqs=8, max_num_batched_tokens=32)
    prompt = [4, 8, 15, 16, 23]
    params = SamplingParams(beam_width=3, n=2, max_tokens=12, ignore_eos=True)
    sched.add_request("b", prompt, params)
    greedy_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = {f"s{i}": [1 + i, 2, 3, 4, 5, 6, 7] for i in range(3)}
    for request_id, p in prompts.items():
        sched.add_request(request_id, p, greedy_params)
    out: dict[str, list] = {}
    beam_preempted = False
    while sched.has_work:
        for event in step(sched, model)[1]:
            out.setdefault(event.request_id, []).append(event)
        beam_preempted |= any(s.beam is not None and s.beam.state.step for s in sched.waiting)
    assert beam_preempted  # a beam was recomputed after preemption and its group waited for it
    search = BeamSearchParams(3, 12, 2, 1.0, eos_token_ids=())
    want = beam_search(prompt, lambda prefixes: [list(enumerate(torch.log_softmax(spread_logits(q), dim=-1).tolist()))
                                                 for q in prefixes], search)
    assert [e.token_ids for e in out["b"] if isinstance(e, Token)] == [h.token_ids for h in want]
    for request_id, p in prompts.items():
        assert [t for e in out[request_id] if isinstance(e, Token) for t in e.token_ids] == greedy(p, 24)
    assert sched.block_manager.num_used == 0


def test_abort_mid_search_frees_every_beam() -> None:
    sched, model = make(num_blocks=40, logits_fn=spread_logits, max_num_seqs=8, max_num_batched_tokens=32)
    sched.add_request("b", [3, 1, 4, 1, 5], SamplingParams(beam_width=4, max_tokens=12))
    for _ in range(4):
        step(sched, model)
    assert len(sched.running) == 4 and sched.block_manager.num_used > 0
    assert sched.abort("b")
    assert sched.block_manager.num_used == 0 and not sched.running and not sched.has_work


def test_beam_parameters_are_checked() -> None:
    for bad in ({"beam_width": 2, "n": 3}, {"beam_width": 2, "stop": ["x"]}, {"beam_width": 2, "logprobs": 1},
                {"beam_width": 99}, {"beam_width": 2, "early_stopping": "sometimes"}):
        with pytest.raises(InvalidParams):
            SamplingParams(**bad)
