"""SamplingParams: what a client may ask of one request's decoding, validated once at the edge.

A frozen, plain-data message: the transport builds it with `from_dict` from client JSON/msgpack
(unknown keys and wrong types are rejected with `InvalidParams`), the scheduler carries it in
StepPlans, and `to_dict` turns it back into msgpack-encodable data. Nobody writes it after
construction. `check_vocab` is separate because the vocabulary size is known only once a model
is loaded.

Semantics follow the OpenAI API where it has a parameter (presence/frequency penalty over
generated tokens, logit_bias, logprobs, stop, n, seed), vLLM's for prompt_logprobs, and Hugging
Face otherwise (repetition_penalty over prompt and output tokens, top_k, min_p). `guide`
constrains the output to a grammar (edgeinfer.core.guides compiles and enforces it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, NoReturn

# Every field's range, checked here once for every front end (docs/PROTOCOL.md lists them).
# Ranges are finite so that no value can overflow the sampler's tensors or beam scoring.
MAX_TEMPERATURE = 100.0  # past ~10 the distribution is already flat; 100 keeps logits / T finite
MAX_LOGPROBS = 20  # OpenAI's limit on top alternatives
MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_PENALTY = 2.0  # presence / frequency, OpenAI's range [-2, 2]
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # HF's x / r or x * r: 1 is off
MAX_LENGTH_PENALTY = 10.0  # |alpha|: length ** alpha stays a normal float for any length
MAX_TOKEN_ID = 2**31 - 1  # ids (top_k too) beyond int32 name no token of any vocabulary
MAX_TOKENS = 1 << 20  # a static bound; the engine also refuses more than the model's context
MAX_N = 64  # choices of one request (the scheduler also caps them at max_num_seqs)
# Bounds on what one client may make every decode step pay for (stop matching is per token).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_BEAM_WIDTH = 16
MAX_GUIDE_SPEC_CHARS = 1 << 16  # a schema, regex or grammar; compiling it is the client's cost to bound
# SamplingParams.guide kinds: the spec is a JSON schema (json_schema), a regex matched by the whole
# output (regex), a grammar (grammar: Lark as llguidance reads it, or llama.cpp's GBNF), or ignored
# (json_object: any JSON object).
GUIDE_KINDS = ("json_object", "json_schema", "regex", "grammar")
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax (division would overflow anyway)


class InvalidParams(ValueError):
    """A client asked for sampling parameters we cannot honour; the message names field and value."""


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters of one request. Defaults change nothing: plain sampling at T=1."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Given as a {token_id: bias} mapping; stored as sorted pairs so the message stays hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and k alternatives
    # None: none; k: each prompt token's logprob (from the second: the first has no context) given
    # the tokens before it, of the model's raw logits, and k alternatives (edgeinfer.core.prompt_logprobs).
    prompt_logprobs: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Beam search instead of sampling when > 0: the n best of beam_width beams, each scored
    # logprob / length ** length_penalty; sampling fields other than logit_bias do not apply.
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False (heuristic) or "never" (exact); see beam_search
    # Structured output: (kind, spec) with kind one of GUIDE_KINDS; every output token must keep
    # the text a prefix of the guide's language, and the output ends when the guide is complete.
    guide: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in bias)))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.guide is not None and not isinstance(self.guide, tuple):
            object.__setattr__(self, "guide", tuple(self.guide))  # msgpack hands back a list
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                _fail(name, getattr(self, name), "must be a finite number")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            _fail("temperature", self.temperature, f"must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not -1 <= self.top_k <= MAX_TOKEN_ID:
            _fail("top_k", self.top_k, "must be >= 1 (at most the vocabulary size), or 0 or -1 to turn it off")
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                _fail(name, getattr(self, name), f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            _fail("repetition_penalty", self.repetition_penalty, f"must be in [{low:g}, {high:g}] (1 means off)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            _fail("logit_bias", len(self.logit_bias), f"has too many entries (at most {MAX_LOGIT_BIAS_ENTRIES})")
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id <= MAX_TOKEN_ID:
                _fail("logit_bias", token_id, "has a key that is not a token id")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                _fail("logit_bias", bias, f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            _fail("seed", self.seed, "must fit in 64 bits")
        if not 1 <= self.n <= MAX_N:
            _fail("n", self.n, f"must be in [1, {MAX_N}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _fail("logprobs", self.logprobs, f"must be null or in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            _fail("prompt_logprobs", self.prompt_logprobs, f"must be null or in [0, {MAX_LOGPROBS}]")
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            _fail("max_tokens", self.max_tokens, f"must be in [1, {MAX_TOKENS}] (and at most the model's context)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", len(self.stop), f"has too many strings (at most {MAX_STOP_STRINGS})")
        for text in self.stop:
            if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_STRING_CHARS:
                _fail("stop", text, f"strings must be non-empty, at most {MAX_STOP_STRING_CHARS} chars")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", len(self.stop_token_ids), f"has too many ids (at most {MAX_STOP_TOKEN_IDS})")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id <= MAX_TOKEN_ID:
                _fail("stop_token_ids", token_id, "has an id that is not a token id")
        if not 0 <= self.beam_width <= MAX_BEAM_WIDTH:
            _fail("beam_width", self.beam_width, f"must be in [0, {MAX_BEAM_WIDTH}] (0: sampling)")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            _fail("length_penalty", self.length_penalty,
                  f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]")
        if self.early_stopping is not True and self.early_stopping is not False and self.early_stopping != "never":
            _fail("early_stopping", self.early_stopping, 'must be true, false or "never"')  # 1 == True: by identity
        if self.guide is not None:
            _check_guide(self.guide)
        if self.beam_width:
            if self.n > self.beam_width:
                _fail("n", self.n, f"must be <= beam_width={self.beam_width} (the n best beams are returned)")
            for name, off in (("stop", ()), ("logprobs", None), ("prompt_logprobs", None), ("presence_penalty", 0.0),
                              ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0),
                              ("guide", None)):
                if getattr(self, name) != off:
                    _fail(name, getattr(self, name), "is not supported with beam search")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalised(self) -> bool:
        """Whether a penalty (repetition, presence or frequency) reads the tokens seen so far."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty or self.frequency_penalty)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidParams if a token id (or top_k) names no token of a vocabulary of this size."""
        if self.top_k > vocab_size:
            _fail("top_k", self.top_k, f"must be at most the vocabulary size {vocab_size} (0 or -1: off)")
        for name, ids in (("logit_bias", [k for k, _ in self.logit_bias]),
                          ("stop_token_ids", self.stop_token_ids)):
            for token_id in ids:
                if token_id >= vocab_size:
                    _fail(name, token_id, f"is not a token id (vocabulary size {vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for msgpack/JSON; `from_dict(p.to_dict()) == p`."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        # String keys: JSON requires them and msgpack's default unpacker only accepts them.
        data["logit_bias"] = {str(k): v for k, v in self.logit_bias}
        data["stop"] = list(self.stop)
        data["stop_token_ids"] = list(self.stop_token_ids)
        data["guide"] = None if self.guide is None else list(self.guide)
        return data

    @classmethod
    def from_dict(cls, data: Any, vocab_size: int | None = None) -> SamplingParams:
        """Build from client data; a null value means the default. Raises InvalidParams."""
        if not isinstance(data, Mapping):
            raise InvalidParams(f"sampling parameters must be an object, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in _KINDS)
        if unknown:
            raise InvalidParams(f"unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs = {k: _coerce(k, v) for k, v in data.items() if v is not None}
        params = cls(**kwargs)
        if vocab_size is not None:
            params.check_vocab(vocab_size)
        return params


# What a model's own files (HF generation_config.json, GGUF general.sampling.*) may choose for a
# request that does not.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a client's request gets for a field it leaves unset where the model's own files say
    nothing: one documented set for every front end (generate, chat, the web page, the websocket
    protocol, the OpenAI API). A request built in code (a tool, a test: params_given None) is
    taken as built; the model's files come first, so a model published as greedy stays greedy."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 512  # the answer's length; the engine also stops at the end of the context


GENERATION_DEFAULTS = GenerationDefaults()


def with_model_defaults(params: SamplingParams, given: frozenset[str],
                        defaults: Mapping[str, Any]) -> SamplingParams:
    """`params` with, in every field the client did not set (`given` names those it did), the
    model's default (MODEL_DEFAULT_FIELDS from `defaults`), else GENERATION_DEFAULTS'. Raises
    InvalidParams if the mix is invalid. Beam search takes only max_tokens: it samples nothing,
    and refuses a repetition penalty."""
    documented = dataclasses.asdict(GENERATION_DEFAULTS)
    if params.beam_width:
        documented = {"max_tokens": documented["max_tokens"]}
        defaults = {}
    chosen = {**documented, **{k: v for k, v in defaults.items() if k in MODEL_DEFAULT_FIELDS}}
    chosen = {k: v for k, v in chosen.items() if k not in given}
    return dataclasses.replace(params, **chosen) if chosen else params


def given_fields(data: Mapping[str, Any]) -> frozenset[str]:
    """The fields client data sets (a null value sets nothing: it means the default)."""
    return frozenset(str(k) for k, v in data.items() if v is not None)


def _fail(name: str, value: Any, problem: str) -> NoReturn:
    big = isinstance(value, int) and abs(value) >= 10**40
    shown = f"an integer of {len(str(abs(value)))} digits" if big else repr(value)
    raise InvalidParams(f"{name} {problem}, got {shown[:100]}")


def _check_guide(guide: tuple[Any, ...]) -> None:
    """The guide's shape: a known kind and a string spec; a json_schema's spec is a JSON object or
    boolean. Whether the library can compile it is checked when it is compiled (core.guides)."""
    if len(guide) != 2 or not all(isinstance(part, str) for part in guide):
        _fail("guide", guide, "must be a pair of strings [kind, spec]")
    kind, spec = guide
    if kind not in GUIDE_KINDS:
        _fail("guide", kind, f"kind must be one of {', '.join(GUIDE_KINDS)}")
    if len(spec) > MAX_GUIDE_SPEC_CHARS:
        _fail("guide", len(spec), f"spec is too long (at most {MAX_GUIDE_SPEC_CHARS} characters)")
    if kind in ("regex", "grammar") and not spec:
        _fail("guide", spec, f"a {kind} guide needs a non-empty spec")
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            _fail("guide", spec, f"json_schema spec is not JSON ({exc})")
        if not isinstance(schema, (dict, bool)):
            _fail("guide", spec, "json_schema spec must be a JSON object (a schema)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python


def _coerce(name: str, value: Any) -> Any:
    """Check one client value's JSON type; return it in the type the dataclass stores."""
    kind = _KINDS[name]
    if kind == "float":
        if not (_is_int(value) or isinstance(value, float)):
            _fail(name, value, "must be a number")
        try:
            return float(value)
        except OverflowError:  # an integer past float range: out of every field's range
            _fail(name, value, "is out of range")
    if kind == "int":
        if not _is_int(value):
            _fail(name, value, "must be an integer")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            _fail(name, value, "must be true or false")
        return value
    if kind == "early":  # checked by SamplingParams itself
        return value
    if kind == "guide":
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, str) for v in value):
            _fail(name, value, "must be a pair of strings [kind, spec]")
        return tuple(value)
    if kind == "stop":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            _fail(name, value, "must be a string or a list of strings")
        return tuple(items)
    if kind == "ids":
        if not isinstance(value, list) or not all(_is_int(t) for t in value):
            _fail(name, value, "must be a list of integer token ids")
        return tuple(value)
    assert kind == "bias", kind
    if not isinstance(value, Mapping):
        _fail(name, value, "must be an object mapping token ids to numbers")
    bias = {}
    for key, bias_value in value.items():
        if _is_int(key):
            token_id = key
        elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            token_id = int(key)
        else:
            _fail(name, key, "keys must be token ids")
        if not (_is_int(bias_value) or isinstance(bias_value, float)):
            _fail(name, bias_value, "values must be numbers")
        if _is_int(bias_value) and abs(bias_value) > MAX_LOGIT_BIAS:
            _fail(name, bias_value, f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        bias[token_id] = float(bias_value)
    return bias


_KINDS = MappingProxyType({
    "temperature": "float", "top_k": "int", "top_p": "float", "min_p": "float",
    "presence_penalty": "float", "frequency_penalty": "float", "repetition_penalty": "float",
    "logit_bias": "bias", "seed": "int", "n": "int", "logprobs": "int", "prompt_logprobs": "int", "max_tokens": "int",
    "min_tokens": "int", "stop": "stop", "stop_token_ids": "ids", "ignore_eos": "bool",
    "beam_width": "int", "length_penalty": "float", "early_stopping": "early", "guide": "guide",
})
