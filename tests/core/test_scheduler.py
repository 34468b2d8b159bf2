"""Scheduler tests: pure Python, tiny pools (block size 4, 8 blocks), a fake model runner.

The fake runner (tests/fake_runner.py) answers a next token that hashes the whole context read
back through the block table, so "same tokens as alone" checks the paging too.
"""

from __future__ import annotations

from dataclasses import asdict

import msgpack
import pytest
from fake_runner import EOS, GREEDY, VOCAB, Letters, expected_tokens, fake_logits, make, run_all, step, tokens_of

from edgeinfer.core.events import (
    INVALID_PARAMS,
    OVERLOADED,
    PROMPT_TOO_LONG,
    Accepted,
    Finished,
    RequestError,
    Token,
)
from edgeinfer.core.messages import StepPlan, StepResult
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.worker.sampler import SamplingBatch, sample


def test_messages_round_trip_msgpack() -> None:
    sched, model = make()
    sched.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, logit_bias={3: 1.5}, stop=["x"],
                                                            max_tokens=8))
    plan = sched.schedule()
    assert StepPlan.from_dict(msgpack.unpackb(msgpack.packb(asdict(plan)))) == plan
    result = model.execute(plan)
    result = StepResult(result.step_id, result.seq_ids, result.token_ids, (-0.5,), (((7, -0.5), (3, -2.0)),),
                        failed=((4, "sampling failed: ValueError: x"),))
    assert StepResult.from_dict(msgpack.unpackb(msgpack.packb(asdict(result)))) == result


def test_continuous_batching_exact_blocks() -> None:
    sched, model = make()
    assert sched.add_request("a", [1, 2, 3, 4, 5], GREEDY) == Accepted("a", 0, 5)
    two = SamplingParams(temperature=0.0, max_tokens=2)
    assert sched.add_request("b", [6, 7, 8], two) == Accepted("b", 1, 3)
    plan, _ = step(sched, model)
    assert [(s.seq_id, s.token_ids, s.start_pos, s.block_table, s.sample) for s in plan.seqs] == [
        (0, (1, 2, 3, 4, 5), 0, (0, 1), True), (1, (6, 7, 8), 0, (2,), True)]
    plan, events = step(sched, model)  # decodes: a's 6th token fits block 1, b's 4th fills block 2
    assert [(s.start_pos, s.block_table) for s in plan.seqs] == [(5, (0, 1)), (3, (2,))]
    assert isinstance(events[-1], Finished) and events[-1].request_id == "b"  # max_tokens=2
    assert sched.stats().num_running == 1 and sched.block_manager.num_used == 2  # b's block is free
    assert sched.add_request("c", [9, 9, 9, 9, 9], GREEDY).queue_position == 0
    plan, _ = step(sched, model)  # c joins the next step while a decodes
    assert [(s.seq_id, s.start_pos, s.block_table) for s in plan.seqs] == [(0, 6, (0, 1)), (2, 0, (3, 4))]
    out = run_all(sched, model)
    assert tokens_of(out["a"]) == expected_tokens([1, 2, 3, 4, 5], 4)[3:]
    assert sched.block_manager.num_used == 0


def test_chunked_prefill_keeps_decodes_running() -> None:
    sched, model = make(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=4)
    sched.add_request("short", [1, 2], SamplingParams(temperature=0.0, max_tokens=8))
    step(sched, model)
    sched.add_request("long", list(range(1, 12)), SamplingParams(temperature=0.0, max_tokens=2))
    chunks = []
    for _ in range(4):
        plan, _ = step(sched, model)
        assert plan.seqs[0].seq_id == 0 and len(plan.seqs[0].token_ids) == 1  # the decode, every step
        chunks.append((plan.seqs[1].start_pos, len(plan.seqs[1].token_ids), plan.seqs[1].sample))
    assert chunks == [(0, 3, False), (3, 3, False), (6, 3, False), (9, 2, True)]
    out = run_all(sched, model)
    assert tokens_of(out["long"]) == expected_tokens(list(range(1, 12)), 2)[1:]


def test_steps_count_their_prompt_tokens() -> None:
    """SeqStep.prompt_tokens: a prompt chunk's length, 0 for a decode row, and for a sequence
    recomputed after a preemption (prompt + output in one chunk) the prompt's length only: the
    model runs those rows on the prompt kernel (cpu_activations bf16-prompts), the rest as
    decodes, so a request's tokens do not depend on whether it was preempted."""
    sched, model = make(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=4)
    sched.add_request("short", [1, 2], SamplingParams(temperature=0.0, max_tokens=8))
    plan, _ = step(sched, model)
    assert plan.seqs[0].prompt_tokens == 2
    sched.add_request("long", list(range(1, 12)), SamplingParams(temperature=0.0, max_tokens=2))
    for _ in range(4):
        plan, _ = step(sched, model)
        assert plan.seqs[0].prompt_tokens == 0  # the decode
        assert plan.seqs[1].prompt_tokens == len(plan.seqs[1].token_ids)  # 3, 3, 3, 2

    sched, model = make(num_blocks=6)
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6))
    recomputed = []  # chunks of several tokens that reach past the prompt: output run again
    while sched.has_work:
        plan, _ = step(sched, model)
        recomputed += [s for s in plan.seqs
                       if len(s.token_ids) > 1 and s.start_pos + len(s.token_ids) > len(prompts[f"r{s.seq_id}"])]
    assert sched.num_preemptions > 0 and recomputed
    for s in recomputed:
        assert s.prompt_tokens == max(0, len(prompts[f"r{s.seq_id}"]) - s.start_pos) < len(s.token_ids)


def test_admission_prices_the_whole_request() -> None:
    sched, model = make()  # 8 blocks of 4 = 32 slots
    params = SamplingParams(temperature=0.0, max_tokens=8)  # 12 + 8 tokens: 5 blocks for life
    for rid in "abc":
        sched.add_request(rid, [ord(rid) % VOCAB] * 12, params)
    sched.add_request("d", [1], SamplingParams(temperature=0.0, max_tokens=3))  # 1 block for life
    plan, first = step(sched, model)
    # a: 3 blocks now, 5 free; b's 5 fit; then 2 free: c's 5 do not, and d may not overtake c.
    assert [(s.seq_id, s.block_table) for s in plan.seqs] == [(0, (0, 1, 2)), (1, (3, 4, 5))]
    assert sched.stats().num_waiting == 2
    out = run_all(sched, model)
    assert sched.num_preemptions > 0  # a and b outgrow the pool together: b is recomputed
    for rid in "abc":
        events = [e for e in first if e.request_id == rid] + out[rid]
        assert tokens_of(events) == expected_tokens([ord(rid) % VOCAB] * 12, 8)
    assert out["c"][-1].usage.queue_time_s >= 0


def test_preemption_recomputes_and_gives_the_same_tokens() -> None:
    sched, model = make(num_blocks=6)
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6))
    out = run_all(sched, model)
    assert sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert tokens_of(out[rid]) == expected_tokens(prompt, 6), rid
        assert isinstance(out[rid][-1], Finished) and out[rid][-1].finish_reason == "length"
    assert sched.block_manager.num_used == 0


def test_prefix_cache_reuse_is_reported() -> None:
    sched, model = make(num_blocks=16)
    prompt = list(range(1, 11))
    sched.add_request("a", prompt, GREEDY)
    run_all(sched, model)
    sched.add_request("b", prompt, GREEDY)
    out = run_all(sched, model)
    assert out["b"][-1].usage.cached_prompt_tokens == 8
    assert tokens_of(out["b"]) == expected_tokens(prompt, 4)


def test_admission_errors() -> None:
    sched, _ = make(max_waiting=2)
    with pytest.raises(RequestError) as err:
        sched.add_request("long", [1] * 32, GREEDY)  # the pool holds 32 tokens: no room to decode
    assert err.value.code == PROMPT_TOO_LONG
    for params in (SamplingParams(n=5), SamplingParams(n=2, max_tokens=30), SamplingParams(logit_bias={VOCAB: 1.0})):
        with pytest.raises(RequestError) as err:
            sched.add_request("bad", [1], params)
        assert err.value.code == INVALID_PARAMS
    sched.add_request("a", [1], GREEDY)
    sched.add_request("b", [1], GREEDY)
    with pytest.raises(RequestError) as err:
        sched.add_request("c", [1], GREEDY)
    assert err.value.code == OVERLOADED and err.value.retry_after_s == 1.0


def test_abort_frees_blocks_mid_prefill() -> None:
    sched, model = make(max_num_batched_tokens=4)
    sched.add_request("a", list(range(1, 15)), GREEDY)
    plan, _ = step(sched, model)
    assert not plan.seqs[0].sample and sched.block_manager.num_used == 4
    assert sched.abort("a")
    assert sched.block_manager.num_used == 0 and not sched.has_work


def test_stop_string_eos_and_text() -> None:
    sched, model = make()
    prompt = [1, 2, 3]
    want = expected_tokens(prompt, 4)
    letters = "".join(Letters().push(t) for t in want)
    sched.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=4, stop=[letters[2:4]]))
    sched.add_request("e", prompt, SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[want[1]]))
    out = run_all(sched, model)
    assert out["s"][-1].finish_reason == "stop" and out["s"][-1].text == letters[:2]
    assert out["e"][-1].finish_reason == "stop" and out["e"][-1].text == letters[:1]


def seeded_choice(prompt: list[int], params: SamplingParams, index: int) -> list[int]:
    """What choice ``index`` of a seeded request must produce, sampled from the true contexts:
    the oracle for parallel sampling (a wrong fork, copy or block table changes the context)."""
    out: list[int] = []
    while len(out) < params.max_tokens:
        batch = SamplingBatch.from_params([params], [prompt], [out], VOCAB, (EOS,), choice_indices=[index])
        out.append(int(sample(fake_logits(prompt + out)[None], batch).token_ids[0]))
        if out[-1] == EOS:
            break
    return out


def choice_tokens(events: list, index: int) -> list[int]:
    return [t for e in events if isinstance(e, Token) and e.index == index for t in e.token_ids]


def test_n_choices_fork_from_one_prefill() -> None:
    sched, model = make(num_blocks=16)
    prompt = [3, 1, 4, 1, 5, 9]  # ends inside a block: the choices copy it on their first append
    params = SamplingParams(temperature=3.0, seed=11, n=3, max_tokens=6)
    sched.add_request("a", prompt, params)
    events = run_all(sched, model)["a"]
    got = [choice_tokens(events, i) for i in range(3)]
    assert got == [seeded_choice(prompt, params, i) for i in range(3)]
    assert len({tuple(g) for g in got}) > 1  # the choices do differ
    finished = events[-1]
    assert isinstance(finished, Finished) and [c["index"] for c in finished.choices] == [0, 1, 2]
    assert [c["completion_tokens"] for c in finished.choices] == [len(g) for g in got]
    assert finished.usage.completion_tokens == sum(len(g) for g in got)
    assert finished.text == finished.choices[0]["text"]
    assert sum(1 for e in events if isinstance(e, Finished)) == 1
    # The prompt was computed once; each choice then fed only its own tokens.
    computed = sum(len(c.token_ids) for chunks in model.runner.steps for c in chunks)
    assert computed == len(prompt) + sum(len(g) - 1 for g in got)
    assert sched.block_manager.num_used == 0


def test_n_choices_under_preemption_and_abort() -> None:
    sched, model = make(num_blocks=10, max_num_seqs=4)
    params = SamplingParams(temperature=2.0, seed=5, n=2, max_tokens=8)
    prompts = {"a": [2, 7, 1, 8, 2], "b": [1, 6, 1, 8, 0, 3, 3]}
    for request_id, prompt in prompts.items():
        sched.add_request(request_id, prompt, params)
    sched.add_request("c", [9, 9, 9], SamplingParams(temperature=2.0, seed=1, n=3, max_tokens=8))
    early = step(sched, model)[1] + step(sched, model)[1]
    assert sched.abort("c") and not sched.abort("c")
    out = run_all(sched, model)
    for event in reversed(early):
        out.setdefault(event.request_id, []).insert(0, event)
    assert sched.num_preemptions > 0
    for request_id, prompt in prompts.items():
        for index in range(2):
            assert choice_tokens(out[request_id], index) == seeded_choice(prompt, params, index)
    assert not any(isinstance(e, Finished) for e in out.get("c", []))
    assert sched.block_manager.num_used == 0
