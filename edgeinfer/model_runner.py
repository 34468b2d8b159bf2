"""Turns a step's plain-data description into the tensors the model reads, runs it, samples.

Owned by the model actor (or a direct caller such as tests): it holds the LlamaModel and the
KV pool and is the only code that touches either. Each step is a list of SeqChunk: a sequence's
new token ids, the position of the first one, and its block table (decided by the block
manager, never here).

With ``graph_batch_sizes`` on a CUDA model, pure-decode steps that fit replay CUDA graphs
(edgeinfer.cuda_graphs, captured on the first such step, on the calling thread); prefill and
mixed steps, and every step on the CPU, run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgeinfer.cuda_graphs import DecodeGraphs
from edgeinfer.device_memory import free_step_bytes
from edgeinfer.host_memory import trim_heap
from edgeinfer.models.llama import BatchMeta, LlamaModel
from kernels.kv_pool import KVPool
from kernels.kv_quant import PLAIN_DTYPES


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


class ModelRunner:
    """The model and its KV pool; runs steps."""

    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        block_size: int,
        graph_batch_sizes: tuple[int, ...] = (),
        max_blocks_per_seq: int | None = None,
        activation_bytes_per_token: int = 0,
    ) -> None:
        """``graph_batch_sizes`` (RuntimeConfig.graph_batch_sizes when cuda_graphs is on) turns
        on decode graphs for a CUDA model; ``max_blocks_per_seq`` bounds the block tables they
        take (default: the model's context or the whole pool, whichever is smaller).
        ``activation_bytes_per_token``: a worst-case step's measured peak per token
        (edgeinfer.device_memory; 0: steps are not capped by free memory)."""
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.activation_bytes_per_token = activation_bytes_per_token
        if pool.k_dtype not in PLAIN_DTYPES:
            model.prepare_quantized_kv()  # before the first key is written (or graph captured)
        self.graphs: DecodeGraphs | None = None
        if graph_batch_sizes and model.device.type == "cuda":
            if max_blocks_per_seq is None:
                max_blocks_per_seq = min(pool.num_blocks, -(-model.config.max_position // block_size))
            self.graphs = DecodeGraphs(model, pool, block_size, graph_batch_sizes, max_blocks_per_seq)

    def free_step_bytes(self) -> int | None:
        """What a step may still allocate on the device (None off CUDA)."""
        return free_step_bytes(self.model.device)

    def capture_graphs(self) -> None:
        """Capture the decode graphs now (else the first decode step does); no-op without them."""
        if self.graphs is not None:
            self.graphs.capture()

    def logits(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """fp32 logits (sum of num_logits, vocab) in chunk order."""
        if self.graphs is not None and self.graphs.fits(chunks):
            return self.graphs.run(chunks)
        token_ids, meta = build_batch(chunks, self.block_size, self.model.device)
        logits = self.model.forward(token_ids, meta, self.pool)
        if not meta.is_decode and self.model.device.type == "cpu":
            # A prompt step's activations free pages between longer-lived small blocks, which
            # stay resident until trimmed (~0.2 ms): bench peak RSS -4 to -6 MB.
            trim_heap()
        return logits
