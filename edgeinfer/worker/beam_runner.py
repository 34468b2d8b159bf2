"""Beam search on a real model: the step function edgeinfer.core.beam_search drives, over a ModelRunner.

Owns a BlockManager over the runner's pool (the pool is this search's alone) and the map from
each live beam's tokens to its sequence there. Beams share KV blocks: the prompt is computed
once, and a beam extended by several tokens is forked into children that share every block of
the parent; a child's first write into a shared partial block copies that block first
(copy-on-write). So W beams cost the prompt's blocks once plus roughly one block per beam per
block_size generated tokens, and each step runs one forward of W single-token rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

import torch

from edgeinfer.core.beam_search import BeamSearchParams, BeamState, Hypothesis, beam_search
from edgeinfer.core.block_manager import BlockManager
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner


def beam_pool_blocks(prompt_len: int, params: BeamSearchParams, block_size: int) -> int:
    """Blocks a search needs at most: the shared prompt plus every beam's own tail, and one
    copy-on-write block per beam."""
    per_beam = -(-params.max_tokens // block_size) + 2
    return -(-prompt_len // block_size) + params.width * per_beam


class BeamStepper:
    """``step(prefixes)`` -> each beam's top ``num_candidates`` (token id, logprob) pairs, for
    beam_search, caching K/V across steps."""

    def __init__(self, runner: ModelRunner, num_candidates: int) -> None:
        self.runner = runner
        self.num_candidates = num_candidates
        self.blocks = BlockManager(runner.pool.num_blocks, runner.block_size)
        self._live: dict[tuple[int, ...], int] = {}  # a beam's tokens -> its sequence, K/V of all of them cached
        self._ids = count()

    def step(self, prefixes: list[list[int]]) -> list[list[tuple[int, float]]]:
        if not self._live:
            if len(prefixes) != 1:
                raise ValueError("the first step takes the prompt alone")
            seq = next(self._ids)
            if self.blocks.allocate(seq, prefixes[0]) is None:
                raise ValueError(f"the pool's {self.blocks.num_blocks} blocks cannot hold the prompt")
            chunks = [SeqChunk(tuple(prefixes[0]), 0, self.blocks.block_table(seq))]
            children = [seq]
        else:
            children, chunks = self._extend(prefixes)
        logits = self.runner.logits(chunks)
        self._live = {tuple(p): seq for p, seq in zip(prefixes, children, strict=True)}
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = logprobs.topk(min(self.num_candidates, logprobs.shape[-1]), dim=-1)
        return [list(zip(ids, values, strict=True)) for ids, values in zip(top.indices.tolist(), top.values.tolist(),
                                                                           strict=True)]

    def _extend(self, prefixes: list[list[int]]) -> tuple[list[int], list[SeqChunk]]:
        parents = self._live
        children = []
        for prefix in prefixes:
            parent = parents.get(tuple(prefix[:-1]))
            if parent is None:
                raise ValueError("each prefix must extend a beam of the previous step by one token")
            child = next(self._ids)
            self.blocks.fork(parent, child)
            children.append(child)
        # Parents go before the appends, so a beam with one child writes its block in place.
        for parent in parents.values():
            self.blocks.free(parent)
        chunks, copies = [], []
        for prefix, child in zip(prefixes, children, strict=True):
            appended = self.blocks.append_slots(child, 1)
            if appended is None:
                raise RuntimeError("beam search ran out of KV blocks (beam_pool_blocks sizes the pool)")
            if appended.copy is not None:
                copies.append((appended.copy.src_block_id, appended.copy.dst_block_id))
            chunks.append(SeqChunk((prefix[-1],), len(prefix) - 1, appended.block_ids))
        self.runner.pool.copy_blocks(copies)
        return children, chunks

    def close(self) -> None:
        """Free every live beam's blocks (the pool is reusable afterwards)."""
        for seq in self._live.values():
            self.blocks.free(seq)
        self._live = {}


def beam_search_tokens(runner: ModelRunner, prompt_ids: Sequence[int], params: BeamSearchParams) -> list[Hypothesis]:
    """The best ``params.num_results`` continuations of ``prompt_ids`` by beam search, best first."""
    need = beam_pool_blocks(len(prompt_ids), params, runner.block_size)
    if runner.pool.num_blocks < need:
        raise ValueError(f"beam search of width {params.width} over {len(prompt_ids)} + {params.max_tokens} "
                         f"tokens needs {need} KV blocks, the pool has {runner.pool.num_blocks}")
    stepper = BeamStepper(runner, BeamState(params).num_candidates)
    try:
        return beam_search(prompt_ids, stepper.step, params)
    finally:
        stepper.close()
