"""Greedy parity of int8 (or bf16) activations (kernels.cpu_a8) against the int16-activation path.

On the default model (or --model), 8 prompts, 32 greedy tokens each: the int16 path's greedy
continuation, then the int8 path's own; where they part, the int16 path's top-2 logit gap at
that step says whether it was a near tie (< --tie, 0.05). Also, teacher-forced on the int16
continuation, every step where the two paths' choices differ and its gap. Exact head on both
(the checkpoint's own output layer), fp32 KV cache, so only the activation rounding differs.
The prompt's tokens are marked as such (bf16-prompts runs them in bf16, the continuation int8x2).
Perplexity is ``edgeinfer eval-ppl MODEL --linear-path int4_cpu --cpu-activations int8|int16``.

    python tools/a8_accuracy.py [--activations int8|int8x2|int8x2-lean|bf16|bf16-prompts] [--model PATH] [--tokens 32]
                                [--tie 0.05]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from edgeinfer.config import RuntimeConfig  # noqa: E402
from edgeinfer.models.llama import LlamaModel  # noqa: E402
from edgeinfer.models.loader import load_model  # noqa: E402
from edgeinfer.models.pull import default_model_path  # noqa: E402
from edgeinfer.worker.batch import SeqChunk, build_batch  # noqa: E402
from edgeinfer.worker.build import build_model  # noqa: E402
from edgeinfer.worker.kv_pools import kv_pool  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "To make a cup of tea, first",
    "The three laws of thermodynamics are",
    "Q: What is 17 times 3?\nA:",
    "My favourite book is",
    "ROMEO: But soft, what light through yonder window breaks?",
]
BLOCK = 16


def _logits(model: LlamaModel, ids: list[int], num_logits: int, prompt_tokens: int) -> torch.Tensor:
    """fp32 (num_logits, vocab): the logits after each of the last ``num_logits`` tokens of ids,
    whose first ``prompt_tokens`` are the prompt."""
    blocks = -(-len(ids) // BLOCK)
    pool = kv_pool(model.config, blocks, BLOCK, "fp32", "fp32", model.device)
    chunk = SeqChunk(tuple(ids), 0, tuple(range(blocks)), num_logits, prompt_tokens=prompt_tokens)
    token_ids, batch = build_batch([chunk], BLOCK, model.device)
    return model.forward(token_ids, batch, pool).float()


def _greedy(model: LlamaModel, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_logits(model, ids, 1, len(prompt))[-1].argmax()))
    return ids[len(prompt):]


def _gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--tie", type=float, default=0.05, help="top-2 logit gap below which a choice is a near tie")
    parser.add_argument("--activations", default="int8",
                        choices=("int8", "int8x2", "int8x2-lean", "bf16", "bf16-prompts"),
                        help="the activation mode judged against int16 (default: int8)")
    args = parser.parse_args()
    loaded = load_model(args.model or default_model_path())
    models = {a: build_model(loaded, RuntimeConfig(linear_path="int4_cpu", cpu_activations=a, exact_head=True))
              for a in ("int16", args.activations)}
    failures = 0
    for text in PROMPTS:
        prompt = loaded.tokenizer.encode(text)
        reference = _greedy(models["int16"], prompt, args.tokens)
        ours = _greedy(models[args.activations], prompt, args.tokens)
        forced = {a: _logits(m, prompt + reference[:-1], args.tokens, len(prompt)) for a, m in models.items()}
        differ = [(j, _gap(forced["int16"][j])) for j in range(args.tokens)
                  if int(forced[args.activations][j].argmax()) != reference[j]]
        split = next((j for j, (a, b) in enumerate(zip(reference, ours, strict=True)) if a != b), None)
        verdict = "identical" if split is None else \
            f"part at token {split}, int16 top-2 gap {_gap(forced['int16'][split]):.3f}"
        bad = [(j, g) for j, g in differ if g >= args.tie]
        failures += len(bad) + (split is not None and _gap(forced["int16"][split]) >= args.tie)
        print(f"{text[:40]!r:44} {verdict}; teacher-forced choices differ at {differ or 'none'}")
    print(f"{'PASS' if failures == 0 else 'FAIL'}: {failures} differences with a top-2 gap >= {args.tie}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
