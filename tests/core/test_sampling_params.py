"""SamplingParams: validation messages, from_dict type checks, msgpack round trip."""

import msgpack
import pytest

from edgeinfer.core.sampling_params import InvalidParams, SamplingParams


def test_defaults_are_valid_and_not_greedy():
    params = SamplingParams()
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": -0.5}, ["temperature", "-0.5"]),
    ({"temperature": float("nan")}, ["temperature", "finite"]),
    ({"top_k": -2}, ["top_k", "-2"]),
    ({"top_p": 0.0}, ["top_p", "0.0"]),
    ({"top_p": 1.5}, ["top_p", "1.5"]),
    ({"min_p": -0.1}, ["min_p"]),
    ({"presence_penalty": 2.5}, ["presence_penalty", "2.5"]),
    ({"frequency_penalty": -3}, ["frequency_penalty", "-3"]),
    ({"repetition_penalty": 0}, ["repetition_penalty"]),
    ({"logit_bias": {5: 101}}, ["logit_bias", "101"]),
    ({"logit_bias": {-1: 1}}, ["logit_bias", "-1"]),
    ({"n": 0}, ["n", "0"]),
    ({"logprobs": 21}, ["logprobs", "21"]),
    ({"prompt_logprobs": -1}, ["prompt_logprobs", "-1"]),
    ({"prompt_logprobs": 21}, ["prompt_logprobs", "21"]),
    ({"max_tokens": 0}, ["max_tokens", "0"]),
    ({"min_tokens": 10, "max_tokens": 5}, ["min_tokens", "10", "max_tokens=5"]),
    ({"stop": [""]}, ["stop"]),
    ({"stop": ["x"] * 17}, ["stop", "too many"]),
    ({"stop_token_ids": [-4]}, ["stop_token_ids", "-4"]),
    ({"seed": 2**64}, ["seed"]),
    ({"early_stopping": 1}, ["early_stopping", "never"]),  # 1 == True, but not a bool
    ({"early_stopping": "always"}, ["early_stopping", "always"]),
    # Issue #19: values that used to pass and then kill the engine (an overflow in the sampler, a
    # division by zero in beam scoring).
    ({"top_k": 2**63}, ["top_k", "9223372036854775808"]),
    ({"top_k": 10**30}, ["top_k", str(10**30)]),
    ({"length_penalty": 1e308, "beam_width": 2}, ["length_penalty", "1e+308"]),
    ({"length_penalty": -1e308, "beam_width": 2}, ["length_penalty", "-1e+308"]),
    ({"temperature": 1e308}, ["temperature", "1e+308"]),
    ({"repetition_penalty": 1e-300}, ["repetition_penalty"]),
    ({"n": 65}, ["n", "65"]),
    ({"max_tokens": 2**64}, ["max_tokens", str(2**64)]),
])
def test_bad_values_name_field_and_value(kwargs, words):
    with pytest.raises(InvalidParams) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_invalid_params_is_a_value_error():
    assert issubclass(InvalidParams, ValueError)


def test_to_dict_round_trips_through_msgpack():
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.1, logit_bias={7: -100, 3: 2.5},
                            seed=1234, n=2, logprobs=5, prompt_logprobs=2, max_tokens=64, min_tokens=3,
                            stop=["\n\n", "END"], stop_token_ids=[9], ignore_eos=True,
                            guide=("json_schema", '{"type": "object"}'))
    wire = msgpack.unpackb(msgpack.packb(params.to_dict()))  # default strict_map_key: str keys
    assert SamplingParams.from_dict(wire) == params
    assert params.logit_bias == ((3, 2.5), (7, -100.0))
    assert hash(params) == hash(SamplingParams.from_dict(wire))


def test_from_dict_accepts_openai_style_values():
    params = SamplingParams.from_dict({"temperature": 1, "stop": "###", "logit_bias": {"50": -1},
                                       "seed": None, "top_p": None})
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.stop == ("###",)
    assert params.logit_bias == ((50, -1.0),)
    assert params.seed is None and params.top_p == 1.0  # null means the default


@pytest.mark.parametrize("data, words", [
    ({"temprature": 0.5}, ["unknown", "temprature"]),
    ({"temperature": "hot"}, ["temperature", "number"]),
    ({"temperature": True}, ["temperature", "number"]),
    ({"top_k": 2.5}, ["top_k", "integer"]),
    ({"n": True}, ["n", "integer"]),
    ({"ignore_eos": 1}, ["ignore_eos", "true or false"]),
    ({"stop": ["a", 3]}, ["stop", "strings"]),
    ({"stop_token_ids": "2"}, ["stop_token_ids", "list"]),
    ({"logit_bias": [1, 2]}, ["logit_bias", "object"]),
    ({"logit_bias": {"abc": 1}}, ["logit_bias", "token ids"]),
    ({"logit_bias": {"1": "x"}}, ["logit_bias", "numbers"]),
    ({"early_stopping": 0}, ["early_stopping", "never"]),
    ({"guide": "json_object"}, ["guide", "pair"]),
    ({"guide": ["yaml", ""]}, ["guide", "json_schema"]),
    ({"guide": ["json_schema", "{not json"]}, ["guide", "not JSON"]),
    ({"guide": ["json_schema", "[1]"]}, ["guide", "object"]),
    ({"guide": ["regex", ""]}, ["guide", "non-empty"]),
    ({"guide": ["regex", "a" * 70000]}, ["guide", "too long"]),
    ({"guide": ["json_object", ""], "beam_width": 2}, ["guide", "beam search"]),
])
def test_from_dict_rejects_wrong_keys_and_types(data, words):
    with pytest.raises(InvalidParams) as info:
        SamplingParams.from_dict(data)
    for word in words:
        assert word in str(info.value)


def test_from_dict_rejects_non_objects():
    with pytest.raises(InvalidParams, match="object"):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_vocab_check():
    SamplingParams.from_dict({"logit_bias": {"99": 1}, "stop_token_ids": [99]}, vocab_size=100)
    with pytest.raises(InvalidParams, match="logit_bias.*100"):
        SamplingParams.from_dict({"logit_bias": {"100": 1}}, vocab_size=100)
    with pytest.raises(InvalidParams, match="stop_token_ids.*100"):
        SamplingParams(stop_token_ids=[100]).check_vocab(100)
    with pytest.raises(InvalidParams, match="top_k.*100.*got 101"):
        SamplingParams(top_k=101).check_vocab(100)
    SamplingParams(top_k=100).check_vocab(100)


def test_model_defaults_fill_only_what_the_client_left_unset() -> None:
    """generation_config.json's sampling fields apply where a request sets none; explicit wins;
    the documented defaults fill what neither sets."""
    from edgeinfer.core.sampling_params import GENERATION_DEFAULTS, given_fields, with_model_defaults

    defaults = {"temperature": 0.3, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 9}
    data = {"temperature": 1.0, "top_k": None, "max_tokens": 5}
    params = SamplingParams.from_dict(data)
    assert given_fields(data) == {"temperature", "max_tokens"}
    filled = with_model_defaults(params, given_fields(data), defaults)
    assert (filled.temperature, filled.top_p, filled.top_k, filled.repetition_penalty, filled.max_tokens) == (
        1.0, GENERATION_DEFAULTS.top_p, 20, 1.05, 5)
    assert with_model_defaults(params, frozenset(SamplingParams.__dataclass_fields__), defaults) == params
    unset = with_model_defaults(SamplingParams(), frozenset(), {})
    assert (unset.temperature, unset.top_p, unset.max_tokens) == (0.7, 0.95, 512)  # the README's table
    assert with_model_defaults(SamplingParams(), frozenset(), defaults).temperature == 0.3  # the model's wins
    beams = SamplingParams(temperature=0.0, beam_width=2, max_tokens=7)
    assert with_model_defaults(beams, frozenset({"max_tokens"}), defaults) == beams  # beams sample nothing
    assert with_model_defaults(beams, frozenset(), defaults).max_tokens == 512
