"""The scheduler's per-sequence state (one SeqState per running choice or beam), a beam search's
group, and the counters it reports. Written only by the scheduler (edgeinfer.core.scheduler and
its sibling modules); plain Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, overload

from edgeinfer.core.beam_search import BeamState
from edgeinfer.core.events import TokenLogprob
from edgeinfer.core.guides import Guide
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.core.speculative import AdaptiveK
from edgeinfer.core.stop import StopChecker


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...


class Tokens(Sequence[int]):
    """A sequence's prompt and output read as one, in place: SeqState.token_ids copies the whole
    context, which a step's scheduling did for every sequence (its few new tokens, the blocks it
    filled) and so grew with the context (tools/bench_scheduler.py)."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: tuple[int, ...], output: list[int]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        p = len(self._prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("Tokens slices step by 1")
            stop = max(start, stop)
            if start >= p:
                return tuple(self._output[start - p:stop - p])
            return self._prompt[start:stop] + tuple(self._output[:max(0, stop - p)])
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(f"token index {index} out of range for {len(self)} tokens")
        return self._prompt[i] if i < p else self._output[i - p]


@dataclass
class BeamGroup:
    """A beam search request's live beams (aligned with state.beams) and this round's reports."""

    request_id: str
    prompt_len: int
    arrival_s: float
    state: BeamState
    seqs: list[SeqState]
    reported: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)  # seq id -> candidates


@dataclass
class KVState:
    """Where a sequence's K/V stands: written by the scheduler's batching and preemption, with
    the block manager's answers."""

    block_table: tuple[int, ...] = ()
    num_slots: int = 0  # token slots the block manager holds for it (0: no blocks)
    num_computed: int = 0  # leading tokens whose K/V is in the pool
    num_cached_tokens: int = 0  # prefix-cache hits at first admission
    peak_blocks: int = 0


@dataclass
class SpecState:
    """Speculative decoding's per-sequence state (edgeinfer.core.drafting)."""

    draft_k: AdaptiveK = field(default_factory=AdaptiveK)  # draft length from the acceptance rate
    draft_computed: int = 0  # leading positions the draft model's pool holds


@dataclass
class Timing:
    """When the sequence was first scheduled and produced tokens (the request's usage)."""

    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None


@dataclass
class SeqState:
    """One running choice or beam. The request's identity is fixed at admission; the output
    fields belong to output.py (tokens through the stop checker and detokenizer), the fork
    fields to forks.py, and each stage's counters to its group: kv, spec, times."""

    seq_id: int
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped by the context and the pool
    arrival_s: float
    detokenizer: Detokenizer
    stop: StopChecker
    index: int = 0  # choice index (n > 1)
    output_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    # Prompt tokens scored so far, in order from the second, until the prompt's last step sends
    # them (edgeinfer.core.prompt_logprobs); None: not asked for, or already sent.
    prompt_logprobs: list[TokenLogprob] | None = None
    to_fork: int = 0  # choices still to fork from this one at its first sample (n - 1, then 0)
    beam: BeamGroup | None = None
    guide: Guide | None = None  # structured output's grammar state (edgeinfer.core.guides)
    kv: KVState = field(default_factory=KVState)
    spec: SpecState = field(default_factory=SpecState)
    times: Timing = field(default_factory=Timing)

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    def tokens(self) -> Tokens:
        """prompt + output without the copy (what a step reads of a long context)."""
        return Tokens(self.prompt_ids, self.output_ids)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_cached: int
    prefix_hit_rate: float
    num_generated_tokens: int
    num_preemptions: int
