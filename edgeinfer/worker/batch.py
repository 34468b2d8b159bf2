"""A step's batch: the plain description of each sequence's new tokens (SeqChunk) turned into
the flattened, variable-length tensors the forward reads (edgeinfer.models.llama.BatchMeta), and
how many prompt tokens one CPU forward takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.models.llama import BatchMeta
from kernels.dispatch import CPU_KERNEL_MAX_M

# Single-stream prompts run in chunks of this many tokens on the CPU: as many rows as the AVX2
# int4 kernel takes (kernels.dispatch), so prefill reads the int4 weights in place instead of
# dequantizing each into a 7 MB fp32 scratch for MKL's GEMM (whose first call also keeps ~5 MB
# of buffers). Measured on the default model (bench, 3 alternated runs): 256-token prompt
# 349-404 tok/s and 388-392 MB peak RSS vs 226-389 / 398-400 with 128-token dequantized chunks;
# 1024 tokens 277-284 / 425-427 vs 218-279 / 446-448 (session 6 had 128 against 256-token chunks
# and the whole prompt: 214 / 179 / 141 tok/s). CUDA runs the whole prompt: there a bigger GEMM
# is the faster one.
CPU_PREFILL_CHUNK = CPU_KERNEL_MAX_M


@dataclass(frozen=True)
class SeqChunk:
    token_ids: tuple[int, ...]  # new tokens this step
    start_pos: int  # position of token_ids[0]; tokens before it are already in the cache
    block_table: tuple[int, ...]  # physical block ids covering positions 0 .. start_pos + len - 1
    num_logits: int = 1  # logits wanted for the last num_logits new tokens (k + 1 when verifying drafts)
    prompt_tokens: int = 0  # how many of token_ids, from the first, are prompt tokens (SeqStep.prompt_tokens)


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> tuple[torch.Tensor, BatchMeta]:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens: list[int] = []
    logits_indices: list[int] = []
    prompt_rows: list[bool] = []
    max_blocks = max(len(c.block_table) for c in chunks)
    tables: list[int] = []  # (S, max_blocks) row-major, padded with 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError("a SeqChunk must carry at least one new token")
        end = chunk.start_pos + n
        table = chunk.block_table
        if len(table) * block_size < end:
            raise ValueError(
                f"block table of {len(table)} blocks cannot hold {end} tokens (block_size {block_size})")
        token_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_pos, end))
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(chunk.start_pos, end))
        base = starts[-1]
        starts.append(base + n)
        context_lens.append(end)
        logits_indices.extend(range(base + n - chunk.num_logits, base + n))
        tables.extend(table)
        tables.extend([0] * (max_blocks - len(table)))
        prompt_rows.extend(i < chunk.prompt_tokens for i in range(n))
    # One host tensor per dtype, cut into views: a decode step's batch is a few tensor
    # constructions (and on CUDA a few copies), not one per field.
    num = len(token_ids)
    longs = torch.tensor(token_ids + positions + slots + logits_indices, dtype=torch.int64).to(device)
    ints = torch.tensor(tables + context_lens + starts, dtype=torch.int32).to(device)
    num_tables = len(tables)
    meta = BatchMeta(
        positions=longs[num:2 * num],
        slot_mapping=longs[2 * num:3 * num],
        block_tables=ints[:num_tables].view(len(chunks), max_blocks),
        context_lens=ints[num_tables:num_tables + len(chunks)],
        query_start_loc=ints[num_tables + len(chunks):],
        logits_indices=longs[3 * num:],
        is_decode=num == len(chunks),
        seq_view=_consecutive_blocks(chunks[0], block_size) if len(chunks) == 1 else None,
        prompt_rows=torch.tensor(prompt_rows) if any(prompt_rows) else None,
    )
    return longs[:num], meta


def _consecutive_blocks(chunk: SeqChunk, block_size: int) -> tuple[int, int] | None:
    """(first block, context length) if the chunk's context sits in consecutive blocks."""
    end = chunk.start_pos + len(chunk.token_ids)
    first = chunk.block_table[0]
    needed = chunk.block_table[: -(-end // block_size)]
    return (first, end) if needed == tuple(range(first, first + len(needed))) else None
