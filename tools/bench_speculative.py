"""Speculative decoding vs plain decoding through the serving engine, one stream, greedy, on the
default model.

Drafters: "ngram" (prompt lookup, SchedulerConfig.speculative "ngram") on the int4 model; "draft"
the int4 model drafting for the same weights held in bf16 (speculative "draft": the
int4-drafts-for-a-wider-format pairing; the bf16 target is the plain baseline there). Prompts:
rewrite / repeat a given text (the answer copies the prompt, so n-gram drafts hit) and a
free-form one (they rarely do). Generation stops at EOS unless --ignore-eos, as a user's request
would; decode time excludes the prefill (the request's usage). Prints acceptance (accepted /
drafted, counted at the target's runner), tokens per target forward, decode tok/s and the
speed-up. Outputs are the same greedy text up to near-ties: a verify forward over k+1 tokens
rounds differently from k+1 one-token forwards on the fast paths, so the tokens columns may
differ slightly.

    python tools/bench_speculative.py [--new-tokens 128] [--repeat 2] [--drafters ngram draft]
                                      [--ignore-eos] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import torch  # noqa: E402

from edgeinfer.config import RuntimeConfig, SchedulerConfig  # noqa: E402
from edgeinfer.core.events import Token  # noqa: E402
from edgeinfer.core.request import GenerateRequest  # noqa: E402
from edgeinfer.core.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.engine.api import Engine  # noqa: E402
from edgeinfer.models.llama import LlamaModel  # noqa: E402
from edgeinfer.models.loader import LoadedModel, load_model  # noqa: E402
from edgeinfer.models.pull import default_model_path, pull  # noqa: E402
from edgeinfer.worker.batch import SeqChunk  # noqa: E402
from edgeinfer.worker.build import build_model, fixed_runner  # noqa: E402
from edgeinfer.worker.model_runner import ModelRunner  # noqa: E402
from quant.formats import QuantizedTensor  # noqa: E402

CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''


def prompts() -> dict[str, str]:
    passage = CORPUS.read_text()[:700] if CORPUS.is_file() else CODE
    return {
        "rewrite": "Rename the function to rolling_mean and return the code, nothing else:\n\n" + CODE,
        "repeat": "Copy this passage exactly:\n\n" + passage,
        "free-form": "Write a short story about a lighthouse keeper who finds a map.",
    }


class CountingRunner:
    """Wraps the target's ModelRunner to count its forwards and the drafts they verify."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.pool, self.model = runner, runner.pool, runner.model
        self.activation_bytes_per_token = runner.activation_bytes_per_token
        self.forwards = self.drafted = 0

    def free_step_bytes(self) -> int | None:
        return self.runner.free_step_bytes()

    def logits(self, chunks: list[SeqChunk]) -> torch.Tensor:
        self.forwards += 1
        self.drafted += sum(c.num_logits - 1 for c in chunks)
        return self.runner.logits(chunks)


def run(target: LlamaModel, draft: LlamaModel | None, loaded: LoadedModel, ids: list[int],
        params: SamplingParams, speculative: str, length: int) -> dict:
    """One request through the engine over already built models; decode rate from its usage."""
    runtime = RuntimeConfig()
    counting = CountingRunner(fixed_runner(target, runtime, length))
    draft_runner = fixed_runner(draft, runtime, length) if speculative == "draft" and draft is not None else None

    async def go() -> list:
        engine = Engine.from_runner(counting, loaded.tokenizer, loaded.config,
                                    SchedulerConfig(speculative=speculative), draft=draft_runner)
        async with engine:
            return [e async for e in engine.generate(GenerateRequest("b", prompt_token_ids=tuple(ids),
                                                                     params=params))]

    events = anyio.run(go)
    usage = events[-1].usage
    n = usage.completion_tokens
    forwards = sum(1 for e in events if isinstance(e, Token)) - 1  # one Token event per step after the first
    accepted = n - 1 - forwards
    return {"tokens": n, "decode_tok_s": (n - 1) / (usage.total_time_s - usage.ttft_s),
            "tokens_per_forward": (n - 1) / max(forwards, 1),
            "acceptance": accepted / counting.drafted if counting.drafted else 0.0}


def bf16_copy(loaded: LoadedModel) -> LoadedModel:
    """The same weights held in bf16: the wider-format target the int4 model drafts for."""
    weights = {k: v.dequantize(torch.bfloat16) if isinstance(v, QuantizedTensor) and k.endswith("proj.weight") else v
               for k, v in loaded.weights.items()}
    return LoadedModel(loaded.config, weights, loaded.tokenizer, loaded.source)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--drafters", nargs="+", choices=("ngram", "draft"), default=["ngram", "draft"])
    parser.add_argument("--ignore-eos", action="store_true", help="always decode --new-tokens tokens")
    parser.add_argument("--prompts", nargs="+", choices=("rewrite", "repeat", "free-form"),
                        default=["rewrite", "repeat", "free-form"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = args.model or (default_model_path() if default_model_path().is_file() else pull())
    runtime = RuntimeConfig()
    loaded = load_model(path)
    tok = loaded.tokenizer
    int4 = build_model(loaded, runtime)
    bf16 = build_model(bf16_copy(loaded), runtime) if "draft" in args.drafters else None
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=args.ignore_eos)
    results = []
    for name, text in ((n, t) for n, t in prompts().items() if n in args.prompts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        length = len(ids) + args.new_tokens + 16
        for drafter_name in args.drafters:
            target, draft = (bf16, int4) if drafter_name == "draft" else (int4, None)
            best: dict[str, dict] = {}
            for _ in range(args.repeat):
                for key, spec in (("plain", "off"), ("speculative", drafter_name)):
                    r = run(target, draft, loaded, ids, params, spec, length)
                    if key not in best or r["decode_tok_s"] > best[key]["decode_tok_s"]:
                        best[key] = r
            results.append({"prompt": name, "drafter": drafter_name, **best,
                            "speedup": best["speculative"]["decode_tok_s"] / best["plain"]["decode_tok_s"]})
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    stop = "EOS ignored" if args.ignore_eos else "stops at EOS"
    print(f"greedy, up to {args.new_tokens} new tokens, {stop}, decode time only")
    print("| prompt | drafter (target) | tokens plain / spec | plain tok/s | speculative tok/s | speed-up | "
          "acceptance | tokens/forward |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["speculative"]
        target = "bf16" if r["drafter"] == "draft" else "int4"
        print(f"| {r['prompt']} | {r['drafter']} ({target}) | {r['plain']['tokens']} / {s['tokens']} | "
              f"{r['plain']['decode_tok_s']:.1f} | {s['decode_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{'-' if s['acceptance'] is None else format(s['acceptance'], '.2f')} | {s['tokens_per_forward']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
