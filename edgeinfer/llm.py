"""Build a ready model from a RuntimeConfig, and the single-stream generator on top of it.

`build_model` is the one place that turns a loaded checkpoint plus runtime settings into a
LlamaModel (linear path, head format, threads). `generate_tokens` drives one sequence through a
ModelRunner with contiguous blocks: the offline path used by `edgeinfer bench` and as the
"alone" oracle in tests. Serving many streams goes through edgeinfer.engine instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from edgeinfer.config import RuntimeConfig
from edgeinfer.loader import LoadedModel
from edgeinfer.model_runner import ModelRunner, SeqChunk
from edgeinfer.models.llama import LlamaModel
from edgeinfer.sampler import SamplingBatch, sample
from edgeinfer.sampling_params import SamplingParams
from kernels.dispatch import resolve_path
from kernels.kv_pool import KVPool


def resolve_device(runtime: RuntimeConfig) -> torch.device:
    if runtime.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if runtime.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA GPU")
    return torch.device(runtime.device)


def build_model(loaded: LoadedModel, runtime: RuntimeConfig, take_weights: bool = False) -> LlamaModel:
    """``take_weights`` empties ``loaded.weights`` as it converts them (halves peak memory); pass it
    when the loaded checkpoint is not used again."""
    device = resolve_device(runtime)
    if runtime.num_threads:
        torch.set_num_threads(runtime.num_threads)
    path = resolve_path(runtime.linear_path, device)
    # The quantized head with exact refinement only pays on the CPU int4 path.
    head_format = "int4" if path == "int4_cpu" else "same"
    return LlamaModel(loaded.config, loaded.weights, linear_path=path, device=device, head_format=head_format,
                      take_weights=take_weights)


def single_stream_runner(model: LlamaModel, runtime: RuntimeConfig, max_tokens: int) -> ModelRunner:
    """A runner whose pool holds exactly one sequence of ``max_tokens``."""
    c = model.config
    num_blocks = -(-max_tokens // runtime.block_size)
    pool = KVPool(c.num_layers, num_blocks, runtime.block_size, c.num_kv_heads, c.head_dim,
                  runtime.key_dtype, runtime.value_dtype, model.device)
    return ModelRunner(model, pool, runtime.block_size)


def generate_tokens(
    runner: ModelRunner,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...] = (),
    prefill_chunk: int | None = None,
) -> Iterator[int]:
    """Yield sampled token ids for one sequence until max_tokens, EOS or a stop token id.
    Stop strings are the caller's business (edgeinfer.stop.StopChecker)."""
    num_blocks = runner.pool.num_blocks
    capacity = num_blocks * runner.block_size
    if len(prompt_ids) + params.max_tokens > capacity:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds "
                         f"the pool's {capacity} slots")
    table = tuple(range(num_blocks))
    vocab = runner.model.config.vocab_size
    output: list[int] = []
    chunk = prefill_chunk or len(prompt_ids)
    start = 0
    while start < len(prompt_ids):  # chunked prefill: only the last chunk's logits matter
        ids = tuple(prompt_ids[start:start + chunk])
        logits = runner.logits([SeqChunk(ids, start, table)])
        start += len(ids)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    while True:
        batch = SamplingBatch.from_params([params], [prompt_ids], [output], vocab, eos_token_ids)
        token = int(sample(logits, batch).token_ids[0])
        output.append(token)
        yield token
        if len(output) >= params.max_tokens or (token in stops and len(output) > params.min_tokens):
            return
        logits = runner.logits([SeqChunk((token,), len(prompt_ids) + len(output) - 1, table)])
