"""Structured output in the scheduler (edgeinfer.core.guides): compilation and its cache, masks
against a brute-force oracle over a finite language, drafts and rollback, completion, and guided
requests through the scheduler and the model actor over the fake runner.

The tokenizer is a 32-token byte-level one (EOS and 31 single characters), the fake runner's
vocabulary, so the fake model's favourite token is often one the grammar refuses.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import msgpack
import pytest
import torch
from fake_runner import EOS, VOCAB, FakeRunner, step
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from edgeinfer.config import SchedulerConfig
from edgeinfer.core.events import INTERNAL, INVALID_PARAMS, Finished, RequestError, Token
from edgeinfer.core.guides import GuideCompiler, GuideError
from edgeinfer.core.messages import StepPlan
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.core.scheduler import Scheduler
from edgeinfer.engine.model_actor import ModelActor

CHARS = '{}[]":, 0123456789abcdefghijklm'  # token i + 1 is CHARS[i]; token 0 is EOS
LANGUAGE = ("abc", "a1", "b2", "ab1", "c")  # a finite language, as a regex and as a set
REGEX = "(" + "|".join(LANGUAGE) + ")"


def tiny_tokenizer_json() -> str:
    vocab = {"<eos>": EOS, **{("Ġ" if c == " " else c): i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return tok.to_str()


def ids(text: str) -> list[int]:
    return [CHARS.index(c) + 1 for c in text]


def text_of(token_ids: list[int]) -> str:
    return "".join(CHARS[t - 1] for t in token_ids if t != EOS)


def allowed(mask: bytes) -> set[int]:
    words = [int.from_bytes(mask[i:i + 4], "little") for i in range(0, len(mask), 4)]
    return {t for t in range(VOCAB) if words[t // 32] >> (t % 32) & 1}


def oracle(prefix: str) -> set[int]:
    """Tokens that keep `prefix` a prefix of a word of LANGUAGE, and EOS when it is one."""
    nexts = {ids(word[len(prefix)])[0] for word in LANGUAGE if word.startswith(prefix) and len(word) > len(prefix)}
    return nexts | ({EOS} if prefix in LANGUAGE else set())


@pytest.fixture
def compiler() -> GuideCompiler:
    return GuideCompiler(tiny_tokenizer_json, VOCAB, (EOS,))


def test_masks_match_a_brute_force_oracle_at_every_prefix(compiler: GuideCompiler) -> None:
    prefixes = sorted({word[:i] for word in LANGUAGE for i in range(len(word) + 1)})
    for prefix in prefixes:
        guide = compiler.guide("regex", REGEX)
        for token_id in ids(prefix):
            assert token_id in allowed(guide.mask())
            guide.advance(token_id)
        assert allowed(guide.mask()) == oracle(prefix), prefix
        # Nothing can follow "abc", "b2" or "ab1" ("a1" neither): complete. "c" too.
        assert guide.is_complete == (prefix in LANGUAGE and not oracle(prefix) - {EOS})


def test_compilation_is_cached_and_states_are_independent(compiler: GuideCompiler) -> None:
    first, second = compiler.guide("regex", REGEX), compiler.guide("regex", REGEX)
    assert compiler.num_cached == 1
    first.advance(ids("a")[0])
    assert allowed(second.mask()) == oracle("")  # the other state did not move
    assert allowed(first.mask()) == oracle("a")
    forked = first.copy()
    forked.advance(ids("b")[0])
    assert allowed(first.mask()) == oracle("a") and allowed(forked.mask()) == oracle("ab")
    compiler.guide("json_object", "")
    assert compiler.num_cached == 2


@pytest.mark.parametrize("kind, spec, words", [
    ("regex", "a(", ["regex", "unclosed group"]),
    ("grammar", "start: foo", ["grammar", "unknown name"]),
    ("json_schema", json.dumps({"type": "strin"}), ["json_schema", "strin"]),
])
def test_uncompilable_guides_name_the_library_problem(compiler: GuideCompiler, kind: str, spec: str,
                                                      words: list[str]) -> None:
    with pytest.raises(GuideError) as info:
        compiler.guide(kind, spec)
    for word in words:
        assert word in str(info.value)


def test_draft_masks_roll_back_and_cut_at_the_first_refused_draft(compiler: GuideCompiler) -> None:
    guide = compiler.guide("regex", REGEX)
    before = guide.mask()
    drafts = ids("ab1")
    masks = guide.masks(drafts)
    assert [allowed(m) for m in masks] == [oracle(""), oracle("a"), oracle("ab"), oracle("ab1")]
    assert guide.mask() == before and allowed(guide.mask()) == oracle("")  # rolled back
    assert guide.num_valid(ids("ab2c")) == 2  # "ab" is a prefix, "ab2" is not
    assert guide.num_valid([]) == 0
    guide.advance(ids("a")[0])  # after the rollback it advances like a fresh state
    assert allowed(guide.mask()) == oracle("a")


def make_scheduler(**config) -> tuple[Scheduler, ModelActor]:  # noqa: ANN003
    cfg = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 32, "kv_watermark": 0.0, **config})
    sched = Scheduler(cfg, num_blocks=48, block_size=4, max_model_len=64, vocab_size=VOCAB, eos_token_ids=(EOS,),
                      bytes_per_token=10, make_detokenizer=lambda: _Chars(),
                      guides=GuideCompiler(tiny_tokenizer_json, VOCAB, (EOS,)))
    return sched, ModelActor(FakeRunner(48, 4), VOCAB, (EOS,))


class _Chars:
    def push(self, token_id: int) -> str:
        return "" if token_id == EOS else CHARS[token_id - 1]


def run(sched: Scheduler, model: ModelActor, plans: list[StepPlan] | None = None) -> dict[str, list]:
    events: dict[str, list] = {}
    for _ in range(200):
        if not sched.has_work:
            return events
        plan, new = step(sched, model)
        if plans is not None:
            plans.append(plan)
        for event in new:
            events.setdefault(event.request_id, []).append(event)
    raise AssertionError("the scheduler did not finish")


def test_guided_requests_through_the_scheduler_stay_in_the_language() -> None:
    sched, model = make_scheduler()
    schema = {"type": "object", "properties": {"k": {"enum": ["ab", "c"]}, "m": {"type": "integer", "minimum": 10,
              "maximum": 99}}, "required": ["k", "m"], "additionalProperties": False}
    sched.add_request("regex", ids("123"), SamplingParams(temperature=0.0, max_tokens=20, guide=("regex", REGEX)))
    sched.add_request("json", ids("45"), SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=40,
                                                        guide=("json_schema", json.dumps(schema))))
    sched.add_request("free", ids("67"), SamplingParams(temperature=0.0, max_tokens=5))
    plans: list[StepPlan] = []
    events = run(sched, model, plans)
    finished = events["regex"][-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "stop" and finished.text in LANGUAGE
    json_done = events["json"][-1]
    assert len(json_done.choices) == 2  # each forked choice kept its own grammar state
    for choice in json_done.choices:
        answer = json.loads(choice["text"])
        assert choice["finish_reason"] == "stop" and answer["k"] in ("ab", "c") and 10 <= answer["m"] <= 99
    free = [t for e in events["free"] if isinstance(e, Token) for t in e.token_ids]
    free_seq_id = 2  # in order of arrival; the forked choice came later
    assert len(free) == 5 and all(not s.guide_masks for p in plans for s in p.seqs if s.seq_id == free_seq_id)
    # The messages stay plain data: the masks ride as bytes through msgpack.
    guided = next(p for p in plans if any(s.guide_masks for s in p.seqs))
    assert StepPlan.from_dict(msgpack.unpackb(msgpack.packb(asdict(guided)))) == guided


def test_prompt_lookup_drafts_are_cut_to_the_grammar_and_verified_under_it() -> None:
    # The fake model repeats "ab1ab1..." (its favourite after any context), so prompt lookup drafts
    # from the prompt's "ab1ab1" and the grammar must cut every draft after a complete "ab1".
    a, b, one = ids("ab1")
    after = {a: b, b: one}

    def logits(context: list[int]) -> torch.Tensor:
        row = torch.zeros(VOCAB)
        row[after.get(context[-1], a)] = 10.0
        return row

    sched, model = make_scheduler(speculative="ngram", speculate_max_seqs=4, max_draft_tokens=4)
    model.runner.logits_fn = logits
    sched.add_request("a", ids("ab1ab1ab1a"), SamplingParams(temperature=0.0, max_tokens=10,
                                                              guide=("regex", "(ab1|ab)(ab1)?")))
    plans: list[StepPlan] = []
    events = run(sched, model, plans)
    assert events["a"][-1].text == "ab1ab1" and events["a"][-1].finish_reason == "stop"
    drafted = [s for p in plans for s in p.seqs if s.draft_ids]
    assert drafted, "prompt lookup should have drafted"
    output = [t for e in events["a"] if isinstance(e, Token) for t in e.token_ids]
    for s in drafted:
        assert len(s.guide_masks) == len(s.draft_ids) + 1
        history = text_of(output[:s.num_output] + list(s.draft_ids))
        assert len(history) <= 6 and "ab1ab1"[:len(history)] == history  # never past the grammar's end


def test_bad_or_unsupported_guides_are_refused_at_add_request() -> None:
    sched, _ = make_scheduler()
    with pytest.raises(RequestError) as info:
        sched.add_request("a", ids("1"), SamplingParams(max_tokens=8, guide=("regex", "a(")))
    assert info.value.code == INVALID_PARAMS and "unclosed group" in str(info.value)
    no_grammar = Scheduler(SchedulerConfig(max_num_batched_tokens=64), num_blocks=8, block_size=4, max_model_len=64,
                           vocab_size=VOCAB, eos_token_ids=(EOS,), bytes_per_token=10, make_detokenizer=_Chars)
    with pytest.raises(RequestError, match="guide"):
        no_grammar.add_request("a", ids("1"), SamplingParams(max_tokens=8, guide=("json_object", "")))


def test_a_token_the_mask_refused_fails_that_request_alone() -> None:
    sched, model = make_scheduler()
    sched.add_request("guided", ids("1"), SamplingParams(temperature=0.0, max_tokens=8, guide=("regex", REGEX)))
    sched.add_request("free", ids("2"), SamplingParams(temperature=0.0, max_tokens=3))
    plan = sched.schedule()
    result = model.execute(plan)
    refused = ids("9")[0]  # no word of the language starts with "9"
    tampered = type(result)(result.step_id, result.seq_ids, (refused, *result.token_ids[1:]))
    events = sched.postprocess(plan, tampered)
    error = next(e for e in events if e.request_id == "guided")
    assert error.code == INTERNAL and "refused token" in error.message
    assert isinstance(run(sched, model)["free"][-1], Finished)
