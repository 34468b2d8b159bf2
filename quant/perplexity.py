"""Perplexity of a model over a fixed slice of a text: the quality number every format reports.

The slice is the first ``num_tokens`` tokens of the text (no BOS added), cut into
non-overlapping windows of ``window`` tokens. Each window runs from an empty cache as one
prefill through the real paged-KV forward (so any KV dtype is measured), and scores the
prediction of its tokens 1..window-1. Perplexity = exp(total NLL / scored tokens). Same text,
same ``num_tokens`` and ``window`` -> comparable numbers across formats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeinfer.models.llama import LlamaModel
from edgeinfer.models.tokenizer import Tokenizer
from edgeinfer.worker.batch import SeqChunk
from edgeinfer.worker.model_runner import ModelRunner
from kernels.kv_pool import KVPool

BLOCK_SIZE = 16


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


def perplexity(
    model: LlamaModel, token_ids: list[int], window: int = 512, kv_dtype: str = "fp32", v_dtype: str | None = None
) -> PerplexityResult:
    """Perplexity over ``token_ids`` in non-overlapping windows (the last partial one included).
    ``kv_dtype`` is K's and V's KV format unless ``v_dtype`` sets V's apart."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens, got {len(token_ids)}")
    c = model.config
    num_blocks = -(-window // BLOCK_SIZE)
    pool = KVPool(
        c.num_layers, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, kv_dtype, v_dtype, device=model.device
    )
    runner = ModelRunner(model, pool, BLOCK_SIZE)
    table = tuple(range(num_blocks))
    total_nll = 0.0
    scored = 0
    windows = 0
    for start in range(0, len(token_ids) - 1, window):
        ids = token_ids[start : start + window]
        if len(ids) < 2:
            break
        logits = runner.logits([SeqChunk(tuple(ids), 0, table, num_logits=len(ids))])  # (n, vocab)
        targets = torch.tensor(ids[1:], device=logits.device)
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), targets, reduction="sum")
        total_nll += nll.item()
        scored += len(ids) - 1
        windows += 1
    mean = total_nll / scored
    return PerplexityResult(math.exp(mean), mean, scored, windows)
