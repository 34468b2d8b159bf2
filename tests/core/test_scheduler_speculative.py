"""Prompt-lookup speculative decoding inside the scheduler and model actor (fake model, tiny
pools): greedy output is unchanged, drafts are accepted and save steps, stops and max_tokens
cut a multi-token step exactly, sampled output stays inside the target's support, and wide
batches do not draft."""

from __future__ import annotations

import torch
from fake_runner import VOCAB, make, run_all, step

from edgeinfer.core.events import Finished, Token
from edgeinfer.core.messages import StepResult
from edgeinfer.core.sampling_params import SamplingParams

PERIOD = 5


def copy_logits(context: list[int]) -> torch.Tensor:
    """A model that repeats its context with period PERIOD (what prompt lookup drafts well),
    with a runner-up token so sampling has somewhere else to go."""
    row = torch.full((VOCAB,), -5.0)
    row[context[-PERIOD]] = 4.0
    row[(context[-PERIOD] + 1) % VOCAB or 1] = 3.0
    return row


def expected(prompt: list[int], n: int) -> list[int]:
    context = list(prompt)
    for _ in range(n):
        context.append(context[-PERIOD])
    return context[len(prompt):]


PROMPT = [7, 3, 9, 4, 6, 7, 3]  # its bigrams recur as the copy continues, so drafts hit
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def test_greedy_output_is_unchanged_and_drafts_save_steps() -> None:
    sched, model = make(num_blocks=16, logits_fn=copy_logits, speculative="ngram")
    sched.add_request("a", PROMPT, GREEDY)
    steps = 0
    events = []
    while sched.has_work:
        plan, new = step(sched, model)  # checks the block manager's invariants every step
        steps += 1
        events += new
    tokens = [t for e in events if isinstance(e, Token) for t in e.token_ids]
    assert tokens == expected(PROMPT, 20)
    assert steps < 12  # 20 tokens in fewer forwards: drafts were accepted
    assert any(len(e.token_ids) > 1 for e in events if isinstance(e, Token))
    assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens == 20
    assert sched.block_manager.num_used == 0


def test_stop_string_inside_an_accepted_run_cuts_it_exactly() -> None:
    sched, model = make(num_blocks=16, logits_fn=copy_logits, speculative="ngram")
    # Letters detokenizer: token t is chr(ord('a') + t % 26); 9 -> 'j', 4 -> 'e'.
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=["je"])
    sched.add_request("a", PROMPT, params)
    events = run_all(sched, model)["a"]
    tokens = [t for e in events if isinstance(e, Token) for t in e.token_ids]
    want = expected(PROMPT, 30)
    cut = next(i for i in range(1, len(want)) if want[i - 1:i + 1] == [9, 4]) + 1
    assert tokens == want[:cut]
    text = "".join(e.text for e in events if isinstance(e, Token))
    assert "je" not in text and events[-1].finish_reason == "stop"


def test_max_tokens_is_exact_with_drafts() -> None:
    sched, model = make(num_blocks=16, logits_fn=copy_logits, speculative="ngram")
    for max_tokens in (1, 2, 7):
        sched.add_request(f"r{max_tokens}", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        events = run_all(sched, model)[f"r{max_tokens}"]
        assert [t for e in events if isinstance(e, Token) for t in e.token_ids] == expected(PROMPT, max_tokens)


def test_sampled_tokens_stay_in_the_target_support() -> None:
    # top_k=2 leaves the copy token and its runner-up; a verification that read the wrong rows
    # or accepted blindly would emit drafts outside them.
    sched, model = make(num_blocks=16, logits_fn=copy_logits, speculative="ngram")
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=24, seed=9)
    sched.add_request("a", PROMPT, params)
    events = run_all(sched, model)["a"]
    tokens = [t for e in events if isinstance(e, Token) for t in e.token_ids]
    assert len(tokens) == 24
    context = list(PROMPT)
    for token in tokens:
        assert token in copy_logits(context).topk(2).indices.tolist()
        context.append(token)


def test_wide_batches_do_not_draft() -> None:
    sched, model = make(num_blocks=16, logits_fn=copy_logits, speculative="ngram", speculate_max_seqs=1)
    sched.add_request("a", PROMPT, GREEDY)
    sched.add_request("b", PROMPT[::-1], GREEDY)
    out = run_all(sched, model)
    assert all(len(e.token_ids) == 1 for events in out.values() for e in events if isinstance(e, Token))
    assert [t for e in out["a"] if isinstance(e, Token) for t in e.token_ids] == expected(PROMPT, 20)


def test_draft_model_rows_count_their_drafts_against_the_step_budget() -> None:
    # The scheduler sends model_drafts = k and the model appends k tokens to the row: a step of
    # 8 tokens holds a decode with 4 drafts (5 tokens) and one with 2 (3), not two with 4.
    sched, _ = make(num_blocks=16, speculative="draft", max_num_batched_tokens=8, max_num_seqs=2)
    for request_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        sched.add_request(request_id, prompt, GREEDY)
    plan = sched.schedule()
    sched.postprocess(plan, StepResult(plan.step_id, tuple(s.seq_id for s in plan.seqs), (7, 8)))
    plan = sched.schedule()
    assert [(len(s.token_ids), s.model_drafts, s.draft_feed) for s in plan.seqs] == [(1, 4, (7,)), (1, 2, (8,))]
    assert sum(len(s.token_ids) + s.model_drafts for s in plan.seqs) == 8
