"""Build a ready model from a RuntimeConfig, and the single-stream generator on top of it.

`build_model` is the one place that turns a loaded checkpoint plus runtime settings into a
LlamaModel (linear path, head format, threads). `generate_tokens` drives one sequence through a
ModelRunner with contiguous blocks: the offline path used by `edgeinfer bench` and as the
"alone" oracle in tests. Serving many streams goes through edgeinfer.engine.api instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from edgeinfer.config import RuntimeConfig
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.core.speculative import PROMPT_LOOKUP_NGRAM_MIN, AdaptiveK, propose_ngram
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.loader import LoadedModel
from edgeinfer.worker.batch import CPU_PREFILL_CHUNK, SeqChunk
from edgeinfer.worker.draft_model import DraftModel
from edgeinfer.worker.kv_calibration import calibration_ids
from edgeinfer.worker.model_runner import ModelRunner
from edgeinfer.worker.sampler import SamplingBatch, processed_logits, sample, sampling_probs
from edgeinfer.worker.verify import verify_greedy, verify_sampled, verify_uniforms
from kernels.dispatch import choose_backend
from kernels.kv_pool import KVPool

NGRAM = "ngram"  # generate_tokens' drafter for prompt lookup


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
    backend = choose_backend(runtime.linear_path, device)
    # The quantized head with exact refinement only pays on the CPU int4 path.
    head_format = "int4" if backend.linear_path == "int4_cpu" else "same"
    return LlamaModel(loaded.config, loaded.weights, backend, head_format=head_format,
                      take_weights=take_weights, kv_calibration_ids=calibration_ids(loaded.tokenizer))


def graph_batch_sizes(runtime: RuntimeConfig) -> tuple[int, ...]:
    """Batch sizes to capture as CUDA graphs (none unless asked; ignored off CUDA)."""
    return runtime.graph_batch_sizes if runtime.cuda_graphs else ()


def single_stream_runner(model: LlamaModel, runtime: RuntimeConfig, max_tokens: int) -> ModelRunner:
    """A runner whose pool holds exactly one sequence of ``max_tokens``."""
    c = model.config
    num_blocks = -(-max_tokens // runtime.block_size)
    pool = KVPool(c.num_layers, num_blocks, runtime.block_size, c.num_kv_heads, c.head_dim,
                  runtime.key_dtype, runtime.value_dtype, model.device)
    return ModelRunner(model, pool, runtime.block_size, graph_batch_sizes=graph_batch_sizes(runtime))




def prefill(runner: ModelRunner, prompt_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Write the prompt's K/V into the runner's one-sequence pool and return the last token's
    logits, ``chunk`` tokens per forward (None: CPU_PREFILL_CHUNK on the CPU, else all)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed to predict the next")
    if chunk is None:
        chunk = CPU_PREFILL_CHUNK if runner.model.device.type == "cpu" else len(prompt_ids)
    if chunk <= 0:
        raise ValueError(f"prefill chunk must be positive, got {chunk}")
    table = tuple(range(runner.pool.num_blocks))
    for start in range(0, len(prompt_ids), chunk):  # only the last chunk's logits matter
        logits = runner.logits([SeqChunk(tuple(prompt_ids[start:start + chunk]), start, table)])
    return logits


def generate_tokens(
    runner: ModelRunner,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...] = (),
    prefill_chunk: int | None = None,
    drafter: str | DraftModel | None = None,
) -> Iterator[int]:
    """Yield sampled token ids for one sequence until max_tokens, EOS or a stop token id.
    Stop strings are the caller's business (edgeinfer.core.stop.StopChecker). The prompt runs
    ``prefill_chunk`` tokens per forward (see ``prefill``).

    ``drafter`` turns on speculative decoding: "ngram" drafts by prompt lookup (n-grams of the
    context), a DraftModel by running that model; the target verifies the drafts in one forward
    with the standard rejection rule, so greedy output is unchanged and sampled output keeps the
    target distribution. The draft length adapts to the acceptance rate. Requests with
    penalties decode plainly: their distribution changes with every accepted token. Drafted K/V
    slots past the accepted tokens are simply overwritten by the next step (slots are by position)."""
    if drafter not in (None, NGRAM) and not isinstance(drafter, DraftModel):
        raise ValueError(f"drafter must be None, {NGRAM!r} or a DraftModel, got {drafter!r}")
    capacity = runner.pool.num_blocks * runner.block_size
    if len(prompt_ids) + params.max_tokens > capacity:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds "
                         f"the pool's {capacity} slots")
    table = tuple(range(runner.pool.num_blocks))
    vocab = runner.model.config.vocab_size
    logits = prefill(runner, prompt_ids, prefill_chunk)
    penalised = params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
    if penalised:
        drafter = None
    if isinstance(drafter, DraftModel):
        drafter.check_target(vocab)
        capacity = min(capacity, drafter.capacity)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    output: list[int] = []
    controller = AdaptiveK()

    def finished() -> bool:
        return len(output) >= params.max_tokens or (output[-1] in stops and len(output) > params.min_tokens)

    token = int(sample(logits, SamplingBatch.from_params([params], [prompt_ids], [output], vocab,
                                                         eos_token_ids, device=logits.device)).token_ids[0])
    while True:
        output.append(token)
        yield token
        if finished():
            return
        pos = len(prompt_ids) + len(output) - 1
        drafts: list[int] = []
        draft_probs = None
        limit = min(controller.k, capacity - pos - 1, params.max_tokens - len(output))
        if drafter == NGRAM:
            drafts = propose_ngram(prompt_ids + output, limit, ngram_min=PROMPT_LOOKUP_NGRAM_MIN)
        elif drafter is not None:
            drafts, draft_probs = drafter.propose(prompt_ids, output, limit, params, eos_token_ids)
        logits = runner.logits([SeqChunk((token, *drafts), pos, table, num_logits=1 + len(drafts))])
        n = len(drafts)
        histories = [output + drafts[:j] for j in range(n + 1)]
        batch = SamplingBatch.from_params([params] * (n + 1), [prompt_ids] * (n + 1), histories, vocab,
                                          eos_token_ids, device=logits.device)
        if not drafts:
            token = int(sample(logits, batch).token_ids[0])
            continue
        draft_ids, num_drafts = torch.tensor([drafts]), torch.tensor([n])
        if params.is_greedy:  # argmax only: no softmax over the vocabulary per position
            ids, emitted = verify_greedy(draft_ids, num_drafts, processed_logits(logits, batch)[None])
        else:
            uniforms = verify_uniforms(params.seed, 0, len(output), n)
            ids, emitted = verify_sampled(draft_ids, num_drafts, sampling_probs(logits, batch)[None],
                                          None if draft_probs is None else draft_probs[None], uniforms[None])
        num_accepted = int(emitted[0]) - 1
        controller = controller.update(n, num_accepted)
        for draft in drafts[:num_accepted]:
            output.append(draft)
            yield draft
            if finished():
                return
        token = int(ids[0, num_accepted])

