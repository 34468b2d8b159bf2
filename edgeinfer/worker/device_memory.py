"""Memory the model actor measures: what the KV pool may take, and what a step may still use.

CUDA: a desktop GPU is shared with the display and other programs, so free memory is read, not
assumed. At start, after the weights are loaded, one worst-case step (the largest the scheduler
plans: max_num_batched_tokens prompt tokens, max_num_seqs sampled rows) runs against a scratch
pool; its activation peak is held back before the pool is sized from what is left. After every
step the free memory is read again (StepResult.free_device_bytes), and the scheduler shrinks the
next step's prefill to what fits (activation bytes per token from the dry run), so another
program taking memory slows a large prefill instead of failing it with an out-of-memory error.
CPU: available RAM at start; steps are not capped (their activations are a few MB).
"""

from __future__ import annotations

import psutil
import torch

from edgeinfer.config import RuntimeConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.worker.batch import SeqChunk, build_batch
from edgeinfer.worker.kv_calibration import prepare_quantized_kv
from edgeinfer.worker.kv_pools import kv_pool

MB = 10**6


def available_memory_bytes(device: torch.device) -> int:
    """Memory a KV pool may take from: free device memory on CUDA, available RAM on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def free_step_bytes(device: torch.device) -> int | None:
    """Bytes a step's activations may still take: the driver's free memory plus what torch's
    cache holds unused; None off CUDA (steps are not capped there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def num_kv_blocks(runtime: RuntimeConfig, bytes_per_block: int, device: torch.device, reserved_bytes: int = 0,
                  context: int | None = None) -> int:
    """Blocks of the pool: a fixed count, a byte budget, a fraction of what is free once
    ``reserved_bytes`` (a worst-case step's activations) are held back, else room for
    ``runtime.parallel`` sequences of ``context`` tokens, refused when that is more than is free."""
    if runtime.num_kv_blocks is not None:
        return runtime.num_kv_blocks
    held = f" after {reserved_bytes / MB:,.0f} MB held for a worst-case step" if reserved_bytes else ""
    if runtime.kv_memory_bytes is not None:  # the user's word: no measurement, no reserve
        budget, held = runtime.kv_memory_bytes, ""
    elif runtime.kv_memory_fraction is not None:
        budget = int(max(0, available_memory_bytes(device) - reserved_bytes) * runtime.kv_memory_fraction)
    else:
        assert context is not None, "the context length sizes the default pool"
        blocks = -(-context // runtime.block_size) * runtime.parallel
        free = max(0, available_memory_bytes(device) - reserved_bytes)
        if blocks * bytes_per_block > free:
            raise ValueError(f"a KV cache for {runtime.parallel} sequences (--parallel) of {context} tokens "
                             f"(--ctx) needs {blocks * bytes_per_block / MB:,.0f} MB, but {free / MB:,.0f} MB "
                             f"are available{held}; lower --ctx or --parallel, or store it as int8 "
                             "(--kv-dtype int8)")
        return blocks
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"a KV memory budget of {budget / MB:,.3f} MB{held} holds no block of "
                         f"{bytes_per_block / MB:,.3f} MB; give the KV cache more memory (--kv-memory; "
                         "RuntimeConfig.kv_memory_bytes or kv_memory_fraction) or lower max_num_batched_tokens")
    return blocks


def worst_case_step_bytes(model: LlamaModel, runtime: RuntimeConfig, step_tokens: int, step_seqs: int) -> int:
    """Peak bytes of one step of ``step_tokens`` tokens (one long prompt chunk, plus one-token
    rows up to ``step_seqs`` sampled rows), measured by running it on CUDA against a scratch pool
    (whose own bytes are not counted); 0 off CUDA. An out-of-memory error here names the step."""
    if model.device.type != "cuda":
        return 0
    c = model.config
    step_seqs = max(1, min(step_seqs, step_tokens))
    long_len = min(step_tokens - (step_seqs - 1), c.max_position)
    bs = runtime.block_size
    long_blocks = -(-long_len // bs)
    ids = [(7 * i + 11) % c.vocab_size for i in range(long_len)]
    chunks = [SeqChunk(tuple(ids), 0, tuple(range(long_blocks)))]
    chunks += [SeqChunk((ids[i % long_len],), 0, (long_blocks + i,)) for i in range(step_seqs - 1)]
    prepare_quantized_kv(model)  # before any quantized key is written (no-op for plain caches)
    torch.cuda.synchronize(model.device)
    pool = kv_pool(c, long_blocks + step_seqs - 1, bs, runtime.key_dtype, runtime.value_dtype, model.device)
    base = torch.cuda.memory_allocated(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    try:
        token_ids, batch = build_batch(chunks, bs, model.device)
        with torch.inference_mode():
            logits = model.forward(token_ids, batch, pool)
            torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)  # the sampler's widest buffers
        torch.cuda.synchronize(model.device)
    except torch.OutOfMemoryError as exc:
        raise MemoryError(f"a worst-case step of {step_tokens} tokens ({step_seqs} sampled rows) does not fit "
                          "next to the weights; lower max_num_batched_tokens or max_num_seqs") from exc
    finally:
        del pool
    peak = torch.cuda.max_memory_allocated(model.device) - base
    torch.cuda.empty_cache()
    return int(peak)
