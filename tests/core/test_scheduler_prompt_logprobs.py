"""Prompt logprobs through the scheduler and the model actor, on a fake model whose logits are a
seeded random function of the whole context: every prompt token's score is checked against the
fake model's own log_softmax at the position before it, so a shifted, repeated or missing
position fails. Chunked prefill, preemption, prefix-cache hits, n > 1 and drafts on the prompt's
last token."""

from __future__ import annotations

from dataclasses import asdict

import msgpack
import pytest
import torch
from fake_runner import VOCAB, make, run_all, step

from edgeinfer.core.events import Finished, PromptLogprobs, Token
from edgeinfer.core.messages import PromptScores, StepPlan, StepResult
from edgeinfer.core.sampling_params import InvalidParams, SamplingParams


def random_logits(context: list[int]) -> torch.Tensor:
    seed = sum((i + 1) * 7919 * (t + 1) for i, t in enumerate(context)) % 2**31
    return 3 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))


def expected(prompt: list[int], k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token, logprob, top k) for prompt tokens 1.. from the fake model's own distribution."""
    out = []
    for i in range(1, len(prompt)):
        logprobs = torch.log_softmax(random_logits(prompt[:i]), dim=-1)
        top = list(zip(*[x.tolist() for x in logprobs.topk(k)][::-1], strict=True))  # (id, logprob) pairs
        out.append((prompt[i], logprobs[prompt[i]].item(), top))
    return out


def check(events: list, prompt: list[int], k: int) -> None:
    """One PromptLogprobs, before the first Token, equal to the oracle."""
    kinds = [type(e) for e in events]
    assert kinds.count(PromptLogprobs) == 1
    assert kinds.index(PromptLogprobs) < kinds.index(Token)
    got = next(e for e in events if isinstance(e, PromptLogprobs)).logprobs
    want = expected(prompt, k)
    assert [lp.token_id for lp in got] == [t for t, _, _ in want]
    assert [lp.logprob for lp in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-5)
    for lp, (_, _, top) in zip(got, want, strict=True):
        assert [t for t, _ in lp.top] == [t for t, _ in top]
        assert [p for _, p in lp.top] == pytest.approx([p for _, p in top], abs=1e-5)


def params(k: int = 0, **kwargs) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 3, "prompt_logprobs": k, **kwargs})


PROMPT = [5, 9, 2, 7, 7, 1, 30, 4, 12, 8, 3]


def test_chunked_prefill_scores_every_prompt_token_once() -> None:
    sched, model = make(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=4, logits_fn=random_logits)
    sched.add_request("a", PROMPT, params(3))
    sched.add_request("b", PROMPT[:6], SamplingParams(temperature=0.0, max_tokens=3))  # not asking
    plans, events = [], []
    while sched.has_work:
        plan, out = step(sched, model)
        plans.append(plan)
        events.extend(out)
    asked = [s.prompt_logprob_ids for p in plans for s in p.seqs if s.seq_id == 0 and s.prompt_logprob_ids]
    assert len(asked) == 3 and sum(asked, ()) == tuple(PROMPT[1:])  # chunks of 4, 4 and 3 positions
    check([e for e in events if e.request_id == "a"], PROMPT, 3)
    assert not any(isinstance(e, PromptLogprobs) for e in events if e.request_id == "b")
    assert all(not s.prompt_logprob_ids for p in plans for s in p.seqs if s.seq_id != 0)


def test_zero_alternatives_and_a_one_token_prompt() -> None:
    sched, model = make(logits_fn=random_logits)
    sched.add_request("a", PROMPT, params(0))
    sched.add_request("one", [6], params(2))
    out = run_all(sched, model)
    check(out["a"], PROMPT, 0)
    assert all(lp.top == () for lp in out["a"][0].logprobs)
    assert out["one"][0] == PromptLogprobs("one", ())  # the first token has no score


def test_preempted_mid_prompt_recomputes_without_reporting_twice() -> None:
    # a's lifetime fills 6 of 7 blocks; b (4 blocks) joins while a decodes and is preempted when a
    # grows into its 4th block, after some chunks of its prompt; it runs again once a is done.
    sched, model = make(num_blocks=7, max_num_seqs=2, max_num_batched_tokens=4, logits_fn=random_logits)
    sched.add_request("a", list(range(1, 10)), SamplingParams(temperature=0.0, max_tokens=12))
    prompt = [(3 * i) % VOCAB for i in range(1, 16)]
    sched.add_request("b", prompt, params(2, max_tokens=1))
    asked, events = [], []
    gathered_when_preempted = None
    while sched.has_work:
        plan, out = step(sched, model)
        events.extend(out)
        for s in plan.seqs:
            if s.seq_id == 1:
                asked.append((s.start_pos, s.prompt_logprob_ids))
        b = sched._by_seq.get(1)
        if b is not None and b in sched.waiting and gathered_when_preempted is None and sched.num_preemptions:
            gathered_when_preempted = len(b.prompt_logprobs)
    assert sched.num_preemptions == 1 and 0 < gathered_when_preempted < len(prompt) - 1
    restarts = [i for i, (start, _) in enumerate(asked) if start == 0]
    assert len(restarts) == 2  # computed from position 0 twice ...
    assert asked[restarts[1]][1] == ()  # ... but the recompute's first chunk scores nothing it had
    assert sum((ids for _, ids in asked), ()) == tuple(prompt[1:])
    check([e for e in events if e.request_id == "b"], prompt, 2)
    assert sched.block_manager.num_used == 0


def test_n_choices_report_the_prompt_once() -> None:
    sched, model = make(num_blocks=16, logits_fn=random_logits)
    sched.add_request("a", PROMPT, params(1, n=3, temperature=1.0, seed=4))
    out = run_all(sched, model)["a"]
    check(out, PROMPT, 1)
    assert sorted({e.index for e in out if isinstance(e, Token)}) == [0, 1, 2]
    assert isinstance(out[-1], Finished) and len(out[-1].choices) == 3


def test_prefix_cache_is_not_read_while_scoring_but_is_written() -> None:
    sched, model = make(num_blocks=16, logits_fn=random_logits)
    sched.add_request("plain", PROMPT, params(None))
    run_all(sched, model)
    sched.add_request("scored", PROMPT, params(0))
    out = run_all(sched, model)["scored"]
    check(out, PROMPT, 0)
    assert out[-1].usage.cached_prompt_tokens == 0  # every position computed, for its logits
    sched.add_request("after", PROMPT, params(None))
    assert run_all(sched, model)["after"][-1].usage.cached_prompt_tokens == 8


def test_drafts_on_the_prompts_last_token_come_after_the_scores() -> None:
    # Chunks of 4 leave the 9th token alone; prompt lookup then drafts from the repeated prompt.
    sched, model = make(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=4, speculative="ngram",
                        logits_fn=random_logits)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    sched.add_request("a", prompt, params(0, max_tokens=6))
    plans, events = [], []
    while sched.has_work:
        plan, out = step(sched, model)
        plans.append(plan)
        events.extend(out)
    assert plans[2].seqs[0].start_pos == 8 and plans[2].seqs[0].draft_ids  # the last prompt token drafted
    check(events, prompt, 0)


def test_messages_round_trip_and_what_is_refused() -> None:
    sched, model = make(logits_fn=random_logits)
    sched.add_request("a", PROMPT, params(2))
    plan = sched.schedule()
    assert plan.seqs[0].prompt_logprob_ids == tuple(PROMPT[1:])
    assert StepPlan.from_dict(msgpack.unpackb(msgpack.packb(asdict(plan)))) == plan
    result = model.execute(plan)
    assert [type(p) for p in result.prompt_logprobs] == [PromptScores]
    assert StepResult.from_dict(msgpack.unpackb(msgpack.packb(asdict(result)))) == result
    with pytest.raises(InvalidParams, match="prompt_logprobs is not supported with beam search"):
        SamplingParams(prompt_logprobs=0, beam_width=2)
    with pytest.raises(InvalidParams, match="prompt_logprobs must be an integer"):
        SamplingParams.from_dict({"prompt_logprobs": 1.5})
