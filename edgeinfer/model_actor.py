"""ModelActor: owns the weights, the KV pool and the sampler; executes StepPlans. Decides nothing.

Writers: the actor's worker thread is the one writer of the KV pool (through the model runner's
forward and `copy_blocks`) and of the sampler's random generator. A StepPlan arrives by value;
the actor copies the blocks it names, runs one forward over every chunk, samples the rows that
ask for it and replies a StepResult by value. Steps run one at a time on one dedicated thread
(CUDA's current device, streams and graphs are per-thread state), awaited from an anyio worker
so the event loop keeps serving clients during a forward pass.

Also here: building a runner from a loaded model, and sizing its KV pool from a memory budget
measured at start (CUDA: free device memory after the weights are loaded; CPU: available RAM).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import anyio
import psutil
import torch

from edgeinfer.config import RuntimeConfig
from edgeinfer.llm import build_model, graph_batch_sizes
from edgeinfer.loader import LoadedModel
from edgeinfer.messages import StepPlan, StepResult
from edgeinfer.model_runner import ModelRunner, SeqChunk
from edgeinfer.sampler import SamplingBatch, sample
from kernels.kv_pool import KVPool, kv_bytes_per_token

log = logging.getLogger(__name__)


class BlockPool(Protocol):
    num_blocks: int
    block_size: int

    def bytes_per_token(self) -> int: ...

    def copy_blocks(self, src_dst: list[tuple[int, int]]) -> None: ...


class StepRunner(Protocol):
    """What the model actor needs of a runner: ModelRunner, or a fake in tests."""

    pool: BlockPool

    def logits(self, chunks: list[SeqChunk]) -> torch.Tensor: ...


class ModelActor:
    """Runs StepPlans on a runner; `handle` is the actor's message handler (see actor.serve)."""

    def __init__(self, runner: StepRunner, vocab_size: int, eos_token_ids: tuple[int, ...],
                 seed: int = 0) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._generator = torch.Generator().manual_seed(seed)  # unseeded requests draw from it
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgeinfer-model")
        self._limiter = anyio.CapacityLimiter(1)  # one step in flight

    async def handle(self, plan: StepPlan) -> StepResult:
        # Not abandoned on cancellation: the step finishes before the actor goes, so nothing
        # touches the pool after the engine has closed.
        future = self._thread.submit(self.execute, plan)
        return await anyio.to_thread.run_sync(future.result, limiter=self._limiter)

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """One step, synchronously (tests call this directly)."""
        if plan.block_copies:
            self.runner.pool.copy_blocks(list(plan.block_copies))
        # One logits row per chunk (its last token); rows of unfinished prefill chunks are dropped.
        chunks = [SeqChunk(s.token_ids, s.start_pos, s.block_table) for s in plan.seqs]
        logits = self.runner.logits(chunks)  # (num chunks, vocab) fp32
        # One sampling row per choice: an n > 1 request's first sample draws n tokens from one row.
        rows = [i for i, s in enumerate(plan.seqs) if s.sample for _ in s.choices]
        if not rows:
            return StepResult(plan.step_id, (), ())
        sampled = [plan.seqs[i] for i in rows]
        batch = SamplingBatch.from_params(
            [s.params for s in sampled], [s.prompt_ids for s in sampled],
            [s.output_ids for s in sampled], self.vocab_size, self.eos_token_ids,
            choice_indices=[c for s in plan.seqs if s.sample for c in s.choices],
            device=logits.device, generator=self._generator,
        )
        out = sample(logits[rows], batch)
        token_ids = tuple(out.token_ids.tolist())
        logprobs = top = None
        if out.logprobs is not None:
            logprobs = tuple(out.logprobs.tolist())
            top_ids, top_lps = out.top_ids.tolist(), out.top_logprobs.tolist()
            top = tuple(
                tuple(zip(top_ids[r][:s.params.logprobs or 0], top_lps[r][:s.params.logprobs or 0],
                          strict=True))
                for r, s in enumerate(sampled))
        return StepResult(plan.step_id, tuple(s.seq_id for s in sampled), token_ids, logprobs, top)


def available_memory_bytes(device: torch.device) -> int:
    """Memory a KV pool may take from: free device memory on CUDA, available RAM on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def num_kv_blocks(runtime: RuntimeConfig, bytes_per_block: int, device: torch.device) -> int:
    """Blocks that fit the budget: a fixed count, a byte budget, or a fraction of what is free."""
    if runtime.num_kv_blocks is not None:
        return runtime.num_kv_blocks
    if runtime.kv_memory_bytes is not None:
        budget = runtime.kv_memory_bytes
    else:
        budget = int(available_memory_bytes(device) * runtime.kv_memory_fraction)
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"a KV memory budget of {budget} bytes holds no block of {bytes_per_block} bytes; "
                         "raise kv_memory_fraction or kv_memory_bytes")
    return blocks


def build_runner(loaded: LoadedModel, runtime: RuntimeConfig) -> ModelRunner:
    """Prepare the weights for the runtime's device and path, then size and allocate the pool."""
    model = build_model(loaded, runtime, take_weights=True)
    device, path, c = model.device, model.linear_path, loaded.config
    bytes_per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim,
                                         runtime.key_dtype, runtime.value_dtype)
    # Measured after the weights are on the device, so the budget is what is really left.
    blocks = num_kv_blocks(runtime, bytes_per_token * runtime.block_size, device)
    pool = KVPool(c.num_layers, blocks, runtime.block_size, c.num_kv_heads, c.head_dim,
                  runtime.key_dtype, runtime.value_dtype, device)
    log.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (K %s, V %s, %s, linear path %s)",
             blocks, runtime.block_size, blocks * runtime.block_size, pool.nbytes() / 2**20,
             runtime.key_dtype, runtime.value_dtype, device, path)
    return ModelRunner(model, pool, runtime.block_size, graph_batch_sizes=graph_batch_sizes(runtime))
