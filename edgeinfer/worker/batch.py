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


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> tuple[torch.Tensor, BatchMeta]:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens: list[int] = []
    logits_indices: list[int] = []
    for chunk in chunks:
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError("a SeqChunk must carry at least one new token")
        end = chunk.start_pos + n
        if len(chunk.block_table) * block_size < end:
            raise ValueError(
                f"block table of {len(chunk.block_table)} blocks cannot hold {end} tokens "
                f"(block_size {block_size})"
            )
        token_ids.extend(chunk.token_ids)
        for pos in range(chunk.start_pos, end):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        base = starts[-1]
        starts.append(base + n)
        context_lens.append(end)
        logits_indices.extend(range(base + n - chunk.num_logits, base + n))
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = torch.zeros((len(chunks), max_blocks), dtype=torch.int32)
    for row, chunk in enumerate(chunks):
        tables[row, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.int32)
    meta = BatchMeta(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        is_decode=all(len(c.token_ids) == 1 for c in chunks),
        seq_view=_consecutive_blocks(chunks[0], block_size) if len(chunks) == 1 else None,
    )
    return torch.tensor(token_ids, dtype=torch.int64, device=device), meta


def _consecutive_blocks(chunk: SeqChunk, block_size: int) -> tuple[int, int] | None:
    """(first block, context length) if the chunk's context sits in consecutive blocks."""
    end = chunk.start_pos + len(chunk.token_ids)
    first = chunk.block_table[0]
    needed = chunk.block_table[: -(-end // block_size)]
    return (first, end) if needed == tuple(range(first, first + len(needed))) else None
