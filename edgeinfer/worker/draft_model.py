"""DraftModel: a small (or more coarsely quantized) model drafting tokens for every drafting row of
a step, before the target verifies them all in its one forward (edgeinfer.worker.verify).

Its KV pool has the target pool's blocks and is read through the same block tables, so the block
manager's allocations and copy-on-write orders serve both pools. Which positions of a sequence the
draft pool holds is the scheduler's bookkeeping: a row's `draft_feed` are the tokens from
`draft_start` on that the draft model has not seen (a prompt chunk, the newest token, or a
catch-up after steps without drafting). One forward feeds every row; rows asking for
`model_drafts` = k then decode k tokens, one batched forward per draft position. A sampled row
draws each draft from the draft model's distribution under the request's own sampling settings
and hands those distributions to the rejection rule, which keeps the target's distribution; a
greedy row takes the argmax. Typical pairing: the int4 weights of a model drafting for its int8
or bf16 conversion; any model with the same vocabulary works.
"""

from __future__ import annotations

import torch

from edgeinfer.core.messages import SeqStep
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from edgeinfer.worker.sampler import (
    SamplingBatch,
    greedy_ids,
    processed_logits,
    sample_from_probs,
    sampling_probs,
    seeded_uniform,
)

# Counter stream of seeded draft draws; verification uses streams 1 and 2 (verify.verify_uniforms).
DRAFT_STREAM = 3


class DraftModel:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    def propose(self, seqs: list[SeqStep], generator: torch.Generator | None = None,
                ) -> tuple[list[tuple[int, ...]], torch.Tensor | None]:
        """Feed every row's `draft_feed`, then draft for the rows with `model_drafts`. Returns
        their drafts, in order, and the (rows, K, V) distributions they were drawn from (K the
        most drafts of a row; zero past a row's own), None when every drafting row is greedy."""
        fed = [s for s in seqs if s.draft_feed]
        if not fed:
            return [], None
        logits = self.runner.logits([SeqChunk(s.draft_feed, s.draft_start, s.block_table) for s in fed])
        rows = [i for i, s in enumerate(fed) if s.model_drafts]
        drafting = [fed[i] for i in rows]
        if not drafting:
            return [], None
        last = logits[rows]
        greedy = all(s.params.is_greedy for s in drafting)
        num = max(s.model_drafts for s in drafting)
        drafts: list[list[int]] = [[] for _ in drafting]
        probs = None if greedy else last.new_zeros(len(drafting), num, self.vocab_size)
        active = list(range(len(drafting)))  # rows still drafting; `last` holds their logits
        for j in range(num):
            seqs_j = [drafting[r] for r in active]
            batch = SamplingBatch.from_params(
                [s.params for s in seqs_j], [s.prompt_ids for s in seqs_j],
                [list(s.output_ids) + drafts[r] for r, s in zip(active, seqs_j, strict=True)], self.vocab_size,
                self.eos_token_ids, choice_indices=[s.choices[0] for s in seqs_j], device=last.device,
                num_outputs=[s.num_output + len(drafts[r]) for r, s in zip(active, seqs_j, strict=True)])
            if greedy:
                tokens = greedy_ids(processed_logits(last, batch)).tolist()
            else:
                dist = sampling_probs(last, batch)
                probs[active, j] = dist
                uniforms = torch.tensor([self._uniform(s, j, generator) for s in seqs_j], dtype=torch.float64)
                tokens = sample_from_probs(dist, uniforms).tolist()
            for r, token in zip(active, tokens, strict=True):
                drafts[r].append(token)
            # The last draft is not fed: if it is accepted, the next step's feed starts with it.
            active = [r for r in active if drafting[r].model_drafts > j + 1]
            if active:
                last = self.runner.logits([SeqChunk(
                    (drafts[r][-1],), drafting[r].draft_start + len(drafting[r].draft_feed) + j,
                    drafting[r].block_table) for r in active])
        return [tuple(d) for d in drafts], probs

    @staticmethod
    def _uniform(seq: SeqStep, j: int, generator: torch.Generator | None) -> float:
        if seq.params.seed is None:
            return float(torch.rand(1, dtype=torch.float64, generator=generator))
        return seeded_uniform(seq.params.seed, seq.choices[0], seq.num_output + j, DRAFT_STREAM)
