"""StepPlan and StepResult: the only messages between the scheduler and the model actor.

Frozen plain data (ints, tuples, SamplingParams) so that `msgpack.packb(asdict(plan))` encodes
them and the model actor could move into another process unchanged. The scheduler is the one
writer of a StepPlan; the model actor is the one writer of a StepResult. Neither holds a
reference to the other's state: block tables and copy orders come from the block manager by way
of the scheduler, token ids come back by value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgeinfer.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a step: compute `token_ids` at positions start_pos.. and, when
    `sample` is set (the chunk reaches the sequence's last token), sample its next token."""

    seq_id: int
    token_ids: tuple[int, ...]  # new tokens whose K/V this step writes
    start_pos: int  # position of token_ids[0]; earlier positions are already in the pool
    block_table: tuple[int, ...]  # physical blocks covering positions 0 .. start_pos + len - 1
    sample: bool  # False for a prefill chunk that does not reach the end of the sequence
    params: SamplingParams
    # For the sampler: the output so far and the prompt, sent only when a penalty reads them
    # (empty otherwise: a decode message stays the same size however long the sequence grows).
    output_ids: tuple[int, ...] = ()
    prompt_ids: tuple[int, ...] = ()
    # Choice indices to sample from this row's logits (seeded draws differ by choice): the
    # sequence's own, or 0..n-1 at the first sample of an n > 1 request, which then forks.
    choices: tuple[int, ...] = (0,)
    # Prompt-lookup drafts riding on a decode step: token_ids is (last token, *draft_ids), the
    # model verifies them and returns the accepted ones plus one sampled token.
    draft_ids: tuple[int, ...] = ()
    # A beam's row: reply this many best next tokens with their log-probabilities (top_logprobs)
    # instead of a sample; the scheduler's beam search picks among them.
    beam_candidates: int = 0
    # Draft-model speculation (edgeinfer.worker.draft_model): the draft model first writes
    # draft_feed, the tokens from position draft_start on that its pool lacks, then drafts
    # model_drafts tokens after them; the model appends those to token_ids and verifies them as
    # it does draft_ids. A prompt chunk feeds the draft model too (model_drafts 0).
    draft_feed: tuple[int, ...] = ()
    draft_start: int = 0
    model_drafts: int = 0

    @property
    def num_drafts(self) -> int:
        """Drafts this row verifies, from prompt lookup or the draft model."""
        return len(self.draft_ids) or self.model_drafts
    # Prompt tokens to score (SamplingParams.prompt_logprobs; edgeinfer.core.prompt_logprobs), in
    # order: those the chunk's last len(...) positions predict; in a chunk that samples, the
    # positions just before its last one (which predicts the first output token). Answered in
    # StepResult.prompt_logprobs.
    prompt_logprob_ids: tuple[int, ...] = ()
    # Structured output (edgeinfer.core.guides): when the row samples, the token bitmask at each
    # sampled position (the next one, then after each draft): packed little-endian int32 words,
    # bit t % 32 of word t // 32 set when token t is allowed. Empty: unconstrained.
    guide_masks: tuple[bytes, ...] = ()
    # How many of token_ids, from the first, are prompt tokens (the rest were generated: decode
    # rows, drafts, or output recomputed after a preemption). The model may run prompt rows on
    # another kernel (cpu_activations bf16-prompts) and keeps every generated row on one.
    prompt_tokens: int = 0
    # Tokens generated so far, sent always: seeded draws and min_tokens read it.
    num_output: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SeqStep:
        fields = dict(data)
        fields["params"] = SamplingParams(**data["params"])
        for name in ("token_ids", "block_table", "output_ids", "prompt_ids", "choices", "draft_ids", "draft_feed",
                     "prompt_logprob_ids", "guide_masks"):
            fields[name] = tuple(data[name])
        return cls(**fields)


@dataclass(frozen=True)
class StepPlan:
    """Everything the model actor needs for one forward pass and the sampling after it."""

    step_id: int
    seqs: tuple[SeqStep, ...]
    # Copy-on-write orders (src block, dst block), applied before the forward writes any K/V.
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepPlan:
        return cls(
            step_id=data["step_id"],
            seqs=tuple(SeqStep.from_dict(s) for s in data["seqs"]),
            block_copies=tuple((src, dst) for src, dst in data["block_copies"]),
        )


@dataclass(frozen=True)
class PromptScores:
    """One sequence's answer to SeqStep.prompt_logprob_ids: each token's log-probability (the
    log_softmax of the raw logits at the position before it) and, when the request asks for k > 0
    alternatives, the k best (token id, logprob) there, best first."""

    seq_id: int
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] = ()  # one per token; () for none

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PromptScores:
        return cls(int(data["seq_id"]), tuple(float(lp) for lp in data["logprobs"]),
                   tuple(tuple((int(t), float(lp)) for t, lp in row) for row in data["top"]))


@dataclass(frozen=True)
class StepResult:
    """What one step sampled, for the plan's rows with `sample` set, in plan order; a row with
    several choices has that many consecutive entries (its seq id repeated). A row that carried
    drafts emits num_emitted[row] tokens (accepted drafts, then the sampled one); token_ids is
    every row's tokens back to back."""

    step_id: int
    seq_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None  # the chosen tokens' logprobs, when any row asked
    # Per row: (token id, logprob) alternatives, best first, as many as that row asked for.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    num_emitted: tuple[int, ...] | None = None  # None: one token per row
    free_device_bytes: int | None = None  # what a step may still allocate (CUDA), read after this one
    # (seq id, why) for rows whose sampling failed: the scheduler fails their requests alone.
    failed: tuple[tuple[int, str], ...] = ()
    prompt_logprobs: tuple[PromptScores, ...] = ()  # for the plan's rows with prompt_logprob_ids, in plan order

    def row_tokens(self) -> list[tuple[int, ...]]:
        """Each row's emitted tokens."""
        counts = self.num_emitted or (1,) * len(self.seq_ids)
        out, start = [], 0
        for n in counts:
            out.append(tuple(self.token_ids[start:start + n]))
            start += n
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepResult:
        top = data["top_logprobs"]
        return cls(
            step_id=data["step_id"],
            seq_ids=tuple(data["seq_ids"]),
            token_ids=tuple(data["token_ids"]),
            logprobs=None if data["logprobs"] is None else tuple(data["logprobs"]),
            top_logprobs=None if top is None else tuple(
                tuple((int(t), float(lp)) for t, lp in row) for row in top),
            num_emitted=None if data.get("num_emitted") is None else tuple(data["num_emitted"]),
            free_device_bytes=data.get("free_device_bytes"),
            failed=tuple((int(seq_id), str(why)) for seq_id, why in data.get("failed", ())),
            prompt_logprobs=tuple(PromptScores.from_dict(p) for p in data.get("prompt_logprobs", ())),
        )
