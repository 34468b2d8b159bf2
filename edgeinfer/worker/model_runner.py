"""Turns a step's plain-data description into the tensors the model reads, runs it, samples.

Owned by the model actor (or a direct caller such as tests): it holds the LlamaModel and the
KV pool and is the only code that touches either. Each step is a list of SeqChunk
(edgeinfer.worker.batch): a sequence's new token ids, the position of the first one, and its
block table (decided by the block manager, never here).

With ``graph_batch_sizes`` on a CUDA model, pure-decode steps that fit replay CUDA graphs
(edgeinfer.worker.cuda_graphs, captured on the first such step, on the calling thread); prefill and
mixed steps, and every step on the CPU, run eagerly.
"""

from __future__ import annotations

import torch

from edgeinfer.models.host_memory import trim_heap
from edgeinfer.models.llama import LlamaModel
from edgeinfer.worker.batch import SeqChunk, build_batch
from edgeinfer.worker.cuda_graphs import DecodeGraphs
from edgeinfer.worker.device_memory import free_step_bytes
from edgeinfer.worker.kv_calibration import prepare_quantized_kv
from edgeinfer.worker.memory_plan import MemoryPlan
from kernels.kv_pool import KVPool


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
        (edgeinfer.worker.device_memory; 0: steps are not capped by free memory)."""
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.activation_bytes_per_token = activation_bytes_per_token
        self.memory_plan: MemoryPlan | None = None  # set by edgeinfer.worker.build for a served model
        if pool.transform_k:
            prepare_quantized_kv(model)  # before the first key is written (or graph captured)
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
