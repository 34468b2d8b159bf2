"""StopChecker: stop strings across token boundaries never reach the client; holdback; EOS,
stop token ids, min_tokens, max_tokens."""

import pytest

from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.core.stop import StopChecker

EOS = 0


def run(params: SamplingParams, deltas: list[str], token_ids: list[int] | None = None):
    """Push deltas (token ids 1, 2, ... unless given); return (per-push emits, text, reason)."""
    checker = StopChecker(params, eos_token_ids=[EOS])
    token_ids = token_ids or list(range(1, len(deltas) + 1))
    emits, reason = [], None
    for token_id, delta in zip(token_ids, deltas, strict=True):
        text, reason = checker.push(token_id, delta)
        emits.append(text)
        if reason is not None:
            break
    return emits, "".join(emits), reason


@pytest.mark.parametrize("deltas", [
    ["Hello", " wor", "ld", "STOP", "after"],  # stop string in one token
    ["Hello", " wor", "ldST", "OP", "after"],  # split across two tokens
    ["Hello", " wor", "ldS", "TO", "Pafter"],  # across three, with text after it
    ["Hello", " wor", "ld", "S", "T", "O", "P"],  # one character a token
    ["Hello", " worldSTOPafter"],  # the text before and after in the same token
])
def test_stop_string_is_caught_and_never_emitted(deltas):
    emits, text, reason = run(SamplingParams(stop=["STOP"]), deltas)
    assert reason == "stop"
    assert text == "Hello world"
    prefix = ""
    for emit in emits:  # no prefix of the stream ever shows any part of the stop string
        prefix += emit
        assert "S" not in prefix


def test_holdback_releases_text_that_turns_out_not_to_be_a_stop():
    emits, text, reason = run(SamplingParams(stop=["STOP"], max_tokens=10), ["aST", "Ob", "c"])
    assert emits[0] == "a"  # "ST" held: it could start "STOP"
    assert emits[1] == "STOb"  # "STOb" cannot, so all of it goes
    assert emits[2] == "c"
    assert reason is None and text == "aSTObc"


def test_holdback_uses_the_longest_possible_prefix_of_any_stop():
    checker = StopChecker(SamplingParams(stop=["abc", "bcd"]), [EOS])
    assert checker.push(1, "xab") == ("x", None)  # "ab" could start "abc"
    assert checker.push(2, "c") == ("", "stop")  # "abc" completed: held "ab" is dropped


def test_earliest_of_several_stop_strings_wins():
    _, text, reason = run(SamplingParams(stop=["world", "lo"]), ["Hello world"])
    assert (text, reason) == ("Hel", "stop")


def test_eos_finishes_and_releases_held_text_without_eos_text():
    _, text, reason = run(SamplingParams(stop=["STOP"]), ["Hi ", "ST", "</s>"], [5, 6, EOS])
    assert (text, reason) == ("Hi ST", "eos")


def test_ignore_eos_keeps_going_until_length():
    _, text, reason = run(SamplingParams(ignore_eos=True, max_tokens=3), ["a", "", "b"], [1, EOS, 2])
    assert (text, reason) == ("ab", "length")


def test_stop_token_id_finishes_with_stop():
    _, text, reason = run(SamplingParams(stop_token_ids=[9]), ["a", "<|end|>"], [1, 9])
    assert (text, reason) == ("a", "stop")


def test_max_tokens_finishes_with_length_and_releases_held_text():
    _, text, reason = run(SamplingParams(stop=["STOP"], max_tokens=2), ["a", "ST"])
    assert (text, reason) == ("aST", "length")


def test_stop_string_on_the_last_allowed_token_is_still_a_stop():
    _, text, reason = run(SamplingParams(stop=["STOP"], max_tokens=2), ["aST", "OP"])
    assert (text, reason) == ("a", "stop")


def test_min_tokens_defers_every_stop_condition():
    params = SamplingParams(stop=["x"], stop_token_ids=[9], min_tokens=3, max_tokens=10)
    emits, text, reason = run(params, ["", "x", "", "a", "x"], [EOS, 2, 9, 4, 5])
    assert emits[:3] == ["", "x", ""]  # EOS, stop string, stop id: all ignored before min_tokens
    assert (text, reason) == ("xa", "stop")


def test_flush_releases_what_is_held():
    checker = StopChecker(SamplingParams(stop=["STOP"]), [EOS])
    assert checker.push(1, "aSTO") == ("a", None)
    assert checker.flush() == "STO"
    assert checker.flush() == ""
    assert checker.num_tokens == 1 and checker.finish_reason is None


def test_pushing_after_finish_is_a_bug():
    checker = StopChecker(SamplingParams(max_tokens=1), [EOS])
    assert checker.push(1, "a") == ("a", "length")
    assert checker.finish_reason == "length"
    with pytest.raises(AssertionError):
        checker.push(2, "b")
