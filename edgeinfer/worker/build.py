"""From a loaded checkpoint and the runtime settings to ready runners: the one place that turns
weights into a LlamaModel (device, linear path, head format, threads) and gives a model its KV
pool, sized from the memory budget measured at start (edgeinfer.worker.device_memory: CUDA, free
device memory after the weights are loaded and a worst-case step has run; CPU, available RAM).

A draft model for speculative decoding gets a pool of the target's shape in blocks, addressed by
the same block tables (the block manager stays the one allocator of both), so the budget is
split between the two pools by their bytes per token.
"""

from __future__ import annotations

import logging

import torch

from edgeinfer.config import RuntimeConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.loader import LoadedModel
from edgeinfer.worker.device_memory import available_memory_bytes, num_kv_blocks, worst_case_step_bytes
from edgeinfer.worker.kv_calibration import calibration_ids
from edgeinfer.worker.kv_pools import bytes_per_token, kv_pool
from edgeinfer.worker.memory_plan import MemoryPlan, check_budget_plan, tensor_bytes
from edgeinfer.worker.model_runner import ModelRunner
from kernels.dispatch import LEAN_ONE_TERM, choose_backend, resolve_cpu_activations

log = logging.getLogger(__name__)


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
    activations = resolve_cpu_activations(runtime.cpu_activations, device)
    backend = choose_backend(runtime.linear_path, device, int8_activations=activations != "int16",
                             a8_terms=2 if activations in ("int8x2", "int8x2-lean", "bf16-prompts") else 1,
                             a8_bf16=activations == "bf16", a8_bf16_prompts=activations == "bf16-prompts",
                             a8_one_term=LEAN_ONE_TERM if activations == "int8x2-lean" else ())
    if backend.linear_path == "int4_cpu":
        log.info("CPU activations: %s%s", activations, " (auto)" if runtime.cpu_activations == "auto" else "")
    # The quantized head with exact refinement only pays on the CPU int4 path.
    head_format = "int4" if backend.linear_path == "int4_cpu" and not runtime.exact_head else "same"
    return LlamaModel(loaded.config, loaded.weights, backend, head_format=head_format,
                      take_weights=take_weights, kv_calibration_ids=calibration_ids(loaded.tokenizer),
                      max_positions=runtime.context_length(loaded.config.max_position))


def graph_batch_sizes(runtime: RuntimeConfig) -> tuple[int, ...]:
    """Batch sizes to capture as CUDA graphs (none unless asked; ignored off CUDA)."""
    return runtime.graph_batch_sizes if runtime.cuda_graphs else ()


def fixed_runner(model: LlamaModel, runtime: RuntimeConfig, num_tokens: int) -> ModelRunner:
    """A runner whose pool holds ``num_tokens`` tokens, whatever memory is free (tools and tests
    that run one sequence of known length)."""
    num_blocks = -(-num_tokens // runtime.block_size)
    pool = kv_pool(model.config, num_blocks, runtime.block_size, runtime.key_dtype, runtime.value_dtype, model.device)
    return ModelRunner(model, pool, runtime.block_size, graph_batch_sizes=graph_batch_sizes(runtime))


def build_runners(loaded: LoadedModel, runtime: RuntimeConfig, step_tokens: int = 512, step_seqs: int = 64,
                  draft: LoadedModel | None = None) -> tuple[ModelRunner, ModelRunner | None]:
    """The serving runner, and the draft model's beside it when ``draft`` is given. Prepares the
    weights for the runtime's device and path, runs a worst-case step of ``step_tokens`` tokens
    and ``step_seqs`` sampled rows (CUDA), then sizes the pools from what is left. A checkpoint
    planned to a memory budget that this machine cannot hold is refused before anything loads."""
    check_budget_plan(dict(loaded.budget_plan), available_memory_bytes(resolve_device(runtime)),
                      runtime.device)
    model = build_model(loaded, runtime, take_weights=True)
    draft_model = None
    if draft is not None:
        if draft.config.vocab_size != loaded.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                             f"target's ({loaded.config.vocab_size}): drafts must use the same token ids")
        draft_model = build_model(draft, runtime, take_weights=True)
    models = [m for m in (model, draft_model) if m is not None]
    k_dtype, v_dtype, bs = runtime.key_dtype, runtime.value_dtype, runtime.block_size
    per_token = sum(bytes_per_token(m.config, k_dtype, v_dtype) for m in models)
    # The draft model's steps run before the target's, one at a time: the larger peak is held back.
    step_bytes = max(worst_case_step_bytes(m, runtime, step_tokens, step_seqs) for m in models)
    context = runtime.context_length(loaded.config.max_position)
    # Measured after the weights are on the device, so the budget is what is really left.
    blocks = num_kv_blocks(runtime, per_token * bs, model.device, reserved_bytes=step_bytes, context=context)
    runners = [ModelRunner(m, kv_pool(m.config, blocks, bs, k_dtype, v_dtype, m.device), bs,
                           graph_batch_sizes=graph_batch_sizes(runtime),
                           activation_bytes_per_token=-(-step_bytes // step_tokens)) for m in models]
    plan = MemoryPlan(device=str(model.device), weight_bytes=sum(tensor_bytes(m.weights) for m in models),
                      kv_bytes=sum(r.pool.nbytes() for r in runners), kv_tokens=blocks * bs, k_dtype=k_dtype,
                      v_dtype=v_dtype, context=context, activation_bytes=step_bytes)
    runners[0].memory_plan = plan
    log.info("memory plan: %s; linear path %s%s", plan.describe(), model.linear_path,
             ", a draft model's weights and pool included" if draft_model is not None else "")
    return runners[0], (runners[1] if len(runners) > 1 else None)
