"""DraftModel: a small (or more coarsely quantized) model proposing tokens for speculative decoding.

Owns its own runner (weights and a one-sequence KV pool) and the list of tokens whose K/V that
pool holds. Each proposal first feeds whatever of the sequence the pool does not have yet
(after a rejection, the tokens past the first disagreement are simply rewritten: slots are by
position), then decodes k tokens one by one. It returns the draft distributions it sampled
from, which the rejection rule in edgeinfer.worker.verify needs so that the emitted tokens keep
the target's distribution. Typical pairing: the int4 weights of a model drafting for its int8 or
bf16 conversion; any model with the same vocabulary works.
"""

from __future__ import annotations

import torch

from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from edgeinfer.worker.sampler import SamplingBatch, processed_logits, sample_from_probs, sampling_probs, seeded_uniform

# Counter stream of seeded draft draws; generate_tokens' verification uses streams 1 and 2.
DRAFT_STREAM = 3


class DraftModel:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._fed: list[int] = []  # tokens whose K/V are in the pool, in position order

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    @property
    def capacity(self) -> int:
        return self.runner.pool.num_blocks * self.runner.block_size

    def check_target(self, vocab_size: int) -> None:
        if vocab_size != self.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.vocab_size} tokens) differs from the "
                             f"target's ({vocab_size}): drafts must use the same token ids")

    def propose(
        self,
        prompt_ids: list[int],
        output: list[int],
        k: int,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
    ) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens continuing prompt_ids + output, and their (k, V) draft distributions
        (None for greedy params: drafts are the draft model's argmax, checked by equality)."""
        tokens = prompt_ids + output
        if k == 0:
            return [], None
        if len(tokens) + k > self.capacity:
            raise ValueError(f"the draft pool holds {self.capacity} tokens, {len(tokens) + k} asked")
        common = 0
        for mine, theirs in zip(self._fed, tokens, strict=False):
            if mine != theirs:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # at least one token fed: it yields the first logits
        table = tuple(range(self.runner.pool.num_blocks))
        feed = tuple(tokens[common:])
        self._fed = tokens[:]
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            logits = self.runner.logits([SeqChunk(feed, len(self._fed) - len(feed), table)])
            batch = SamplingBatch.from_params([params], [prompt_ids], [output + drafts], self.vocab_size,
                                              eos_token_ids, device=logits.device)
            if params.is_greedy:
                token = int(processed_logits(logits, batch).argmax(dim=-1)[0])
            else:
                dist = sampling_probs(logits, batch)
                token = int(sample_from_probs(dist, self._uniform(params, len(output) + j))[0])
                probs.append(dist[0])
            drafts.append(token)
            if j + 1 < k:  # the last draft is fed by the next proposal, if it is accepted
                feed = (token,)
                self._fed.append(token)
        return drafts, (torch.stack(probs) if probs else None)

    @staticmethod
    def _uniform(params: SamplingParams, step: int) -> torch.Tensor:
        if params.seed is None:
            return torch.rand(1, dtype=torch.float64)
        return torch.tensor([seeded_uniform(params.seed, 0, step, DRAFT_STREAM)], dtype=torch.float64)
