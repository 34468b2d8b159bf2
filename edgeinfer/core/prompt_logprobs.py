"""Prompt log-probabilities (SamplingParams.prompt_logprobs, vLLM's name; what an OpenAI
completion with echo and logprobs reports, and what perplexity is made of): for each prompt
token from the second, its log-probability given the tokens before it (the log_softmax of the
model's raw logits: no sampling parameter applies) and, for k > 0, the k likeliest tokens there.

How the scheduler gathers them. A sequence that asks keeps the scores so far in
SeqState.prompt_logprobs. A prefill chunk over positions start..end-1 asks the model to score
the prompt tokens those positions predict (SeqStep.prompt_logprob_ids: tokens start+1..end, at
most up to the last prompt token, and none it already holds); the model actor answers in
StepResult.prompt_logprobs. The step that samples the first token sends them all as one
PromptLogprobs event, before that Token, and drops the list (None). So:
- chunked prefill: each chunk adds the tokens its positions predict;
- preemption: a sequence recomputed from the start keeps its list and asks only for tokens it
  does not hold yet, so no token is reported twice; once sent, a recompute asks for none;
- n > 1: the choices fork from the sequence after its prompt's last step, without a list: one
  event per request;
- the prefix cache: a cached block holds K/V but no logits, so while a sequence still gathers it
  reuses no cached block (it computes every position, as vLLM does); its own full blocks are still
  committed for other requests to share. Requests that do not ask change nothing.
Beam search refuses prompt_logprobs (as it refuses logprobs).
"""

from __future__ import annotations

from edgeinfer.core.events import Event, PromptLogprobs, TokenLogprob
from edgeinfer.core.messages import SeqStep, StepResult
from edgeinfer.core.sequence import SeqState


def prompt_logprob_ids(seq: SeqState, start: int, end: int) -> tuple[int, ...]:
    """The prompt tokens a chunk over positions start..end-1 of ``seq`` (a sequence still
    gathering) has the model score: those its positions predict that ``seq`` does not hold yet."""
    assert seq.prompt_logprobs is not None
    first = max(start, len(seq.prompt_logprobs)) + 1  # token i is predicted at position i - 1
    return tuple(seq.prompt_ids[first:min(end + 1, len(seq.prompt_ids))])


def gather_prompt_logprobs(seq: SeqState, step: SeqStep, result: StepResult) -> list[Event]:
    """Add a step's scores to ``seq``'s list; at the prompt's last step, the event with all of them."""
    assert seq.prompt_logprobs is not None
    if step.prompt_logprob_ids:
        scores = next(p for p in result.prompt_logprobs if p.seq_id == seq.seq_id)
        top = scores.top or ((),) * len(scores.logprobs)
        seq.prompt_logprobs.extend(TokenLogprob(token_id, logprob, alternatives) for token_id, logprob, alternatives
                                   in zip(step.prompt_logprob_ids, scores.logprobs, top, strict=True))
    if not step.sample:
        return []
    assert len(seq.prompt_logprobs) == len(seq.prompt_ids) - 1, "a prompt token was scored twice or never"
    event = PromptLogprobs(seq.request_id, tuple(seq.prompt_logprobs))
    seq.prompt_logprobs = None
    return [event]
