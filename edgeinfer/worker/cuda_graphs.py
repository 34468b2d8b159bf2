"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A small model's decode step is a few hundred short kernels; launching them from Python costs
more than running them. So pure-decode steps (every sequence has one new token) are captured
once per bucket size and replayed. The algorithm:

- A step of S sequences runs in the smallest captured bucket B >= S (``select_bucket``); steps
  with prefill tokens, more sequences than the largest bucket or a block table longer than
  ``max_blocks`` run eagerly (the caller's business, see ``DecodeGraphs.fits``).
- Inputs live in static buffers of the largest bucket (token ids, positions, slot mapping,
  block tables, context lens); a bucket's graph reads their first B rows. ``pad_decode_batch``
  fills rows S..B-1 with padding: token 0 at position 0, slot -1 (KVPool.write skips negative
  slots, so padding writes nothing and no pool block is reserved for it), context length 1 over
  block 0 (read, never written; its output row is dropped).
- Attention's grid depends on the longest context; inside a graph it is fixed at capture to
  ``max_blocks * block_size``, and the decode kernel skips the partitions past each row's
  context, so one graph serves every context length up to that.
- Capture warms every bucket up eagerly first (Triton compiles and the GEMMs tune their tile
  configs per M bucket; nothing can be timed during capture), then captures largest first into
  one shared memory pool. Graphs are per thread: capture and replay on the model's one thread.

The graphs run LlamaModel.forward itself, with ``BatchMeta.max_context_len`` set to that
capacity so attention never reads ``context_lens.max()`` back from the GPU.

Owns the static buffers and the graphs of one ModelRunner; only ``DecodeGraphs.run`` writes the
buffers. It never writes block tables (the block manager does) and never allocates pool blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgeinfer.models.llama import BatchMeta, LlamaModel
from kernels.kv_pool import KVPool

PAD_SLOT = -1  # KVPool.write skips negative slots


def select_bucket(num_seqs: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size that holds ``num_seqs``; None when none does."""
    if num_seqs <= 0:
        raise ValueError(f"a decode step needs at least one sequence, got {num_seqs}")
    fitting = [b for b in batch_sizes if b >= num_seqs]
    return min(fitting) if fitting else None


def check_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated positive batch sizes, or ValueError."""
    sizes = tuple(sorted(set(batch_sizes)))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"graph batch sizes must be a non-empty set of positive ints, got {tuple(batch_sizes)}")
    return sizes


@dataclass(frozen=True)
class DecodeInputs:
    """One padded decode step on the host; row i < num_seqs is sequence i, the rest padding."""

    num_seqs: int
    token_ids: torch.Tensor  # (B,) int64
    positions: torch.Tensor  # (B,) int64
    slot_mapping: torch.Tensor  # (B,) int64, PAD_SLOT in padding rows
    block_tables: torch.Tensor  # (B, max_blocks) int32, zero-padded
    context_lens: torch.Tensor  # (B,) int32, 1 in padding rows


def pad_decode_batch(
    chunks: Sequence[object], bucket: int, max_blocks: int, block_size: int
) -> DecodeInputs:
    """Host tensors for ``chunks`` (SeqChunks of one token each) padded to ``bucket`` rows."""
    num_seqs = len(chunks)
    if not 0 < num_seqs <= bucket:
        raise ValueError(f"{num_seqs} sequences do not fit a bucket of {bucket}")
    token_ids = torch.zeros(bucket, dtype=torch.int64)
    positions = torch.zeros(bucket, dtype=torch.int64)
    slots = torch.full((bucket,), PAD_SLOT, dtype=torch.int64)
    tables = torch.zeros((bucket, max_blocks), dtype=torch.int32)
    context_lens = torch.ones(bucket, dtype=torch.int32)
    for row, chunk in enumerate(chunks):
        if len(chunk.token_ids) != 1:
            raise ValueError(f"a decode step takes one new token per sequence, row {row} has "
                             f"{len(chunk.token_ids)}")
        pos = chunk.start_pos
        table = chunk.block_table
        if len(table) > max_blocks:
            raise ValueError(f"row {row}: block table of {len(table)} blocks exceeds the graphs' {max_blocks}")
        if len(table) * block_size <= pos:
            raise ValueError(f"row {row}: block table of {len(table)} blocks cannot hold position {pos}")
        token_ids[row] = chunk.token_ids[0]
        positions[row] = pos
        slots[row] = table[pos // block_size] * block_size + pos % block_size
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        context_lens[row] = pos + 1
    return DecodeInputs(num_seqs, token_ids, positions, slots, tables, context_lens)


class DecodeGraphs:
    """Static decode buffers of ``max(batch_sizes)`` rows and one CUDA graph per batch size.

    ``use_graphs=False`` runs the same padded static-buffer path eagerly (the CPU tests do).
    Graphs are captured on the first ``run`` (or by ``capture``), on the calling thread.
    """

    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        block_size: int,
        batch_sizes: Sequence[int],
        max_blocks: int,
        use_graphs: bool = True,
    ) -> None:
        if use_graphs and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on CUDA, got {model.device}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.batch_sizes = check_batch_sizes(batch_sizes)
        self.max_blocks = max_blocks
        self.use_graphs = use_graphs
        device = model.device
        rows = self.batch_sizes[-1]
        self._token_ids = torch.zeros(rows, dtype=torch.int64, device=device)  # (B,)
        self._positions = torch.zeros(rows, dtype=torch.int64, device=device)  # (B,)
        self._slots = torch.full((rows,), PAD_SLOT, dtype=torch.int64, device=device)  # (B,)
        self._tables = torch.zeros((rows, max_blocks), dtype=torch.int32, device=device)  # (B, max_blocks)
        self._context_lens = torch.ones(rows, dtype=torch.int32, device=device)  # (B,)
        self._rows = torch.arange(rows + 1, dtype=torch.int64, device=device)  # query starts / logits rows
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_context_len(self) -> int:
        return self.max_blocks * self.block_size

    def fits(self, chunks: Sequence[object]) -> bool:
        """Whether this step can run here: pure decode, few enough rows, short enough tables."""
        return (
            0 < len(chunks) <= self.batch_sizes[-1]
            and all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)
            and all(len(c.block_table) <= self.max_blocks for c in chunks)
        )

    def _meta(self, bucket: int) -> BatchMeta:
        # The capacity bound replaces reading the longest context back from the device.
        return BatchMeta(
            positions=self._positions[:bucket],
            slot_mapping=self._slots[:bucket],
            block_tables=self._tables[:bucket],
            context_lens=self._context_lens[:bucket],
            query_start_loc=self._rows[: bucket + 1].to(torch.int32),
            logits_indices=self._rows[:bucket],
            is_decode=True,
            max_context_len=self.max_context_len,
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model.forward(self._token_ids[:bucket], self._meta(bucket), self.pool)

    def _reset_padding(self) -> None:
        self._token_ids.zero_()
        self._positions.zero_()
        self._slots.fill_(PAD_SLOT)
        self._tables.zero_()
        self._context_lens.fill_(1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every bucket up, then capture one graph per bucket; all rows are padding, so the
        pool is not written."""
        if not self.use_graphs or self._graphs:
            return
        self._reset_padding()
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.batch_sizes:
                for _ in range(2):  # compile + tune, then once more on the tuned configs
                    self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(self.model.device)
        mempool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.batch_sizes):  # largest first: the rest reuse its memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                out = self._forward(bucket)
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize(self.model.device)

    @torch.inference_mode()
    def run(self, chunks: Sequence[object]) -> torch.Tensor:
        """fp32 logits (len(chunks), vocab) for a decode step that ``fits``."""
        bucket = select_bucket(len(chunks), self.batch_sizes)
        if bucket is None or not self.fits(chunks):
            raise ValueError(f"this step ({len(chunks)} sequences) does not fit the decode graphs")
        if self.use_graphs and not self._graphs:
            self.capture()
        inputs = pad_decode_batch(chunks, bucket, self.max_blocks, self.block_size)
        # Host -> device into the static buffers the graphs read (non_blocking: pageable copies
        # are staged synchronously by CUDA, so the host tensors may be freed at once).
        for dst, src in ((self._token_ids, inputs.token_ids), (self._positions, inputs.positions),
                         (self._slots, inputs.slot_mapping), (self._tables, inputs.block_tables),
                         (self._context_lens, inputs.context_lens)):
            dst[:bucket].copy_(src, non_blocking=True)
        if not self.use_graphs:
            return self._forward(bucket)[: inputs.num_seqs]
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[: inputs.num_seqs].clone()  # the next replay overwrites ``out``
