"""Structured output: compiling a request's guide (SamplingParams.guide) and the grammar state of
each guided sequence, with llguidance (the grammar library vLLM and SGLang use too).

Ownership: the scheduler owns every Guide (one per guided sequence, in SeqState.guide) and is its
only writer; the model actor never sees one. Per sampled position the scheduler sends the
matcher's token bitmask as plain bytes in SeqStep.guide_masks (little-endian int32 words, bit
t % 32 of word t // 32 set when token t is allowed); the batched sampler sets every other token's
logit to -inf before anything picks (edgeinfer.worker.sampler). Each accepted token advances the
matcher, accepted speculative drafts included: prompt-lookup drafts are cut to the prefix the
grammar accepts, their positions' masks computed by consuming them and rolling back, so the
target's distribution at every position is the guided one and rejection sampling stays exact.
The output ends ("stop") once the grammar can take nothing more.

Compilation is cached by (kind, spec): a compiled matcher is kept as a template and each sequence
gets a deep copy (microseconds; compiling a schema takes a millisecond or more, a large one far
more). The engine compiles a request's guide into the cache in a worker thread before it reaches
the scheduler (`GuideCompiler.compile`), so neither that nor the library's tokenizer (built on
first use) blocks the event loop; the cache is therefore guarded by a lock.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from edgeinfer.core.sampling_params import InvalidParams

# JSON as models write it and OpenAI's strict mode returns it: ", " and ": " between items, no
# other whitespace, so a small model cannot spend its tokens on newlines inside an object.
JSON_OPTIONS: llguidance.JsonCompileOptions = {"item_separator": ", ", "key_separator": ": ",
                                               "whitespace_flexible": False}


class GuideError(InvalidParams):
    """A guide the grammar library cannot compile; the message carries the library's reason."""


class Guide:
    """One sequence's grammar state: the mask of the tokens allowed next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self._mask: bytes | None = None  # for the current state; None once it advanced

    def copy(self) -> Guide:
        """An independent state at the same point (a forked choice continues from here)."""
        return Guide(self._matcher.deep_copy())

    def mask(self) -> bytes:
        """The bitmask of the tokens allowed next (cached until the state advances)."""
        if self._mask is None:
            self._mask = self._matcher.compute_bitmask()
        return self._mask

    def num_valid(self, draft_ids: Sequence[int]) -> int:
        """How many of draft_ids, from the first, the grammar accepts from here."""
        return self._matcher.validate_tokens(list(draft_ids)) if draft_ids else 0

    def masks(self, draft_ids: Sequence[int] = ()) -> tuple[bytes, ...]:
        """The masks at the next position and after each of draft_ids (which the grammar must
        accept: see num_valid), found by consuming the drafts and rolling them back: the state
        is unchanged when this returns."""
        masks = [self.mask()]
        for token_id in draft_ids:
            self._consume(token_id)
            masks.append(self._matcher.compute_bitmask())
        if draft_ids:
            self._matcher.rollback(len(draft_ids))
        return tuple(masks)

    def advance(self, token_id: int) -> None:
        """Take an accepted token. Raises RuntimeError for a token the mask did not allow (a bug:
        the scheduler fails that request alone)."""
        self._consume(token_id)
        self._mask = None

    @property
    def is_complete(self) -> bool:
        """The grammar can take nothing more: the output is finished."""
        return self._matcher.is_stopped()

    def _consume(self, token_id: int) -> None:
        # Checked even under -O: a matcher left in its error state would let any token through.
        if not self._matcher.consume_token(token_id) or self._matcher.is_error():
            raise RuntimeError(f"the guide refused token {token_id}: {self._matcher.get_error()[:300]}")


class GuideCompiler:
    """Compiles guides for one model's tokenizer; built lazily on the first guided request (the
    library's tokenizer takes ~0.4 s to build for a 49k vocabulary)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = 128) -> None:
        """``tokenizer_json``: the HF tokenizers JSON of the model's tokenizer; ``vocab_size``: the
        model's (the masks' width); ``eos_token_ids``: the tokens a complete output may end with."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()  # LRU
        self._max_cached = max_cached
        self._lock = threading.Lock()  # the cache: the engine's worker threads fill it, the scheduler reads
        self._tokenizer_lock = threading.Lock()

    def compile(self, kind: str, spec: str) -> llguidance.LLMatcher:
        """The compiled template of a guide, from the cache or compiled now. Raises GuideError."""
        key = (kind, spec)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        template = self._compile(kind, spec)  # outside the lock: it may take long
        with self._lock:
            self._templates[key] = template
            if len(self._templates) > self._max_cached:
                self._templates.popitem(last=False)
        return template

    def guide(self, kind: str, spec: str) -> Guide:
        """A fresh state of the guide, compiled once per (kind, spec). Raises GuideError."""
        return Guide(self.compile(kind, spec).deep_copy())

    @property
    def num_cached(self) -> int:
        return len(self._templates)

    def _compile(self, kind: str, spec: str) -> llguidance.LLMatcher:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self._vocab_size,
                                                         eos_token=self._eos_token_ids)
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        elif kind == "json_schema":
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec), JSON_OPTIONS)
            except ValueError as exc:
                raise GuideError(f"guide: the json_schema cannot be compiled by llguidance: {exc}") from None
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            assert kind == "grammar", kind  # SamplingParams checked the kind
            try:  # Lark as llguidance reads it, or llama.cpp's GBNF (converted to Lark)
                grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
            except Exception as exc:  # the converter raises what its parser meets  # noqa: BLE001
                raise GuideError(f"guide: the grammar is neither Lark nor GBNF: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GuideError(f"guide: the {kind} cannot be compiled by llguidance: {matcher.get_error()}")
        return matcher
