"""Perplexity of a model over a fixed slice of a text: the quality number every format reports.

The slice is the first ``num_tokens`` tokens of the text (no BOS added), cut into
non-overlapping windows of ``window`` tokens. Each window is one engine request whose prompt is
the window's tokens (no BOS added), with max_tokens 1 and prompt_logprobs 0: the engine returns
the log-probability of each of its tokens 1..window-1 given the tokens before it, computed from
an empty cache through the real paged-KV forward (a request scoring its prompt reuses no cached
prefix, so windows never see each other, and attention reads the keys and values back from the
pool: any KV dtype is measured). Perplexity = exp(total NLL / scored tokens). Windows run as
concurrent requests, which the scheduler batches. Same text, same ``num_tokens`` and ``window``
-> comparable numbers across formats.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from edgeinfer.config import RuntimeConfig, SchedulerConfig
from edgeinfer.core.events import Error, PromptLogprobs
from edgeinfer.core.request import GenerateRequest
from edgeinfer.core.sampling_params import SamplingParams
from edgeinfer.engine.api import Engine, EngineConfig
from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.worker.build import resolve_device
from edgeinfer.worker.kv_pools import kv_pool
from edgeinfer.worker.model_runner import ModelRunner

# Windows submitted at once: enough to fill many steps, far below the engine's waiting-queue
# bound (SchedulerConfig.max_waiting), so a long text never meets `overloaded`.
MAX_WINDOWS_IN_FLIGHT = 64


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_scored: int
    num_windows: int


def text_tokens(tokenizer: Tokenizer, path: str | Path, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of a text file (encoding only as much text as needed)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    chars = num_tokens * 6
    while True:
        ids = tokenizer.encode(text[:chars], add_special=False)
        if len(ids) > num_tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) < num_tokens:
        raise ValueError(f"{path} has only {len(ids)} tokens; asked for {num_tokens}")
    return ids[:num_tokens]


async def perplexity(engine: Engine, token_ids: Sequence[int], window: int = 512,
                     progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity over ``token_ids`` in non-overlapping windows (the last partial one included),
    each window one request to ``engine``; ``progress(done, total)`` after each window. Raises
    ValueError if the engine refuses or fails one."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens, got {len(token_ids)}")
    windows = [tuple(token_ids[start:start + window]) for start in range(0, len(token_ids) - 1, window)]
    nll = [0.0] * len(windows)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    slots = anyio.Semaphore(MAX_WINDOWS_IN_FLIGHT)
    failures: list[str] = []
    done = [0]

    async def score(index: int) -> None:
        async with slots:
            request = GenerateRequest(f"ppl-{index}", prompt_token_ids=windows[index], params=params)
            async for event in engine.generate(request):
                if isinstance(event, PromptLogprobs):
                    nll[index] = -sum(lp.logprob for lp in event.logprobs)
                elif isinstance(event, Error):  # the other windows are cancelled: the figure is lost
                    failures.append(f"window {index} of {len(windows)} failed: {event.code}: {event.message}")
                    tg.cancel_scope.cancel()
                    return
        done[0] += 1
        if progress:
            progress(done[0], len(windows))

    async with anyio.create_task_group() as tg:
        for index in range(len(windows)):
            tg.start_soon(score, index)
    if failures:
        raise ValueError(failures[0])
    scored = sum(len(ids) - 1 for ids in windows)
    mean = sum(nll) / scored
    return PerplexityResult(math.exp(mean), mean, scored, len(windows))


def num_kv_blocks(window: int, block_size: int, scheduler: SchedulerConfig) -> int:
    """A KV pool for perplexity windows: the windows one step's token budget reaches (it may end one
    and start the next ones) and one more waiting to start. A larger pool holds no more work."""
    windows = scheduler.max_num_batched_tokens // window + 2
    return windows * -(-(window + 1) // block_size)  # a window's prompt and its one sampled token


def engine_config(model_path: str, window: int, runtime: RuntimeConfig) -> EngineConfig:
    """An engine for perplexity over ``window``-token windows: the model run as ``runtime`` says
    (device, linear path, KV dtypes), its pool sized by num_kv_blocks."""
    scheduler = SchedulerConfig().for_device(resolve_device(runtime).type)
    blocks = num_kv_blocks(window, runtime.block_size, scheduler)
    return EngineConfig(model_path, dataclasses.replace(runtime, num_kv_blocks=blocks), scheduler)


def model_perplexity(model: LlamaModel, tokenizer: Tokenizer, token_ids: Sequence[int], window: int = 512,
                     kv_dtype: str = "fp32", v_dtype: str | None = None) -> PerplexityResult:
    """perplexity() on an engine over an already-built model (tools comparing variants of one
    model); ``kv_dtype`` is K's and V's KV format unless ``v_dtype`` sets V's apart."""
    c, scheduler, block_size = model.config, SchedulerConfig().for_device(model.device.type), RuntimeConfig().block_size
    pool = kv_pool(c, num_kv_blocks(window, block_size, scheduler), block_size, kv_dtype, v_dtype or kv_dtype,
                   model.device)
    engine = Engine.from_runner(ModelRunner(model, pool, block_size), tokenizer, c, scheduler)

    async def run() -> PerplexityResult:
        async with engine:
            return await perplexity(engine, token_ids, window)

    return anyio.run(run)
