"""Prompt-lookup speculative decoding vs plain decoding, single stream, on the default model.

Two prompts: one that asks to rewrite a given text (the answer repeats the prompt, so n-gram
drafts hit) and a free-form one (drafts rarely hit). Decode time excludes the prefill. Prints
acceptance rate (accepted / drafted), tokens per forward, decode tok/s and the speed-up.

    python tools/bench_speculative.py [--new-tokens 128] [--repeat 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeinfer.config import RuntimeConfig  # noqa: E402
from edgeinfer.llm import build_model, generate_tokens, single_stream_runner  # noqa: E402
from edgeinfer.loader import load_model  # noqa: E402
from edgeinfer.pull import default_model_path, pull  # noqa: E402
from edgeinfer.sampling_params import SamplingParams  # noqa: E402

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
    """Wraps a ModelRunner to count decode forwards and drafted tokens."""

    def __init__(self, runner) -> None:  # noqa: ANN001
        self.runner, self.pool, self.block_size, self.model = runner, runner.pool, runner.block_size, runner.model
        self.forwards = self.drafted = 0

    def logits(self, chunks):  # noqa: ANN001, ANN201
        self.forwards += 1
        self.drafted += sum(c.num_logits - 1 for c in chunks)
        return self.runner.logits(chunks)


def run(runner, ids: list[int], params: SamplingParams, speculative: bool) -> dict:  # noqa: ANN001
    counting = CountingRunner(runner)
    stream = generate_tokens(counting, ids, params, (), speculative=speculative)
    next(stream)  # the prefill's token
    prefill_forwards = counting.forwards
    start = time.perf_counter()
    n = 1 + sum(1 for _ in stream)
    elapsed = time.perf_counter() - start
    forwards = counting.forwards - prefill_forwards
    accepted = n - 1 - forwards
    return {"tokens": n, "decode_tok_s": (n - 1) / elapsed, "tokens_per_forward": (n - 1) / max(forwards, 1),
            "acceptance": accepted / counting.drafted if counting.drafted else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = args.model or (default_model_path() if default_model_path().is_file() else pull())
    loaded = load_model(path)
    tok = loaded.tokenizer
    runtime = RuntimeConfig()
    model = build_model(loaded, runtime, take_weights=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    results = {}
    for name, text in prompts().items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        runner = single_stream_runner(model, runtime, len(ids) + args.new_tokens + 16)
        best = {}
        for _ in range(args.repeat):
            for spec in (False, True):
                r = run(runner, ids, params, spec)
                key = "speculative" if spec else "plain"
                if key not in best or r["decode_tok_s"] > best[key]["decode_tok_s"]:
                    best[key] = r
        results[name] = {**best, "speedup": best["speculative"]["decode_tok_s"] / best["plain"]["decode_tok_s"]}
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"greedy, {args.new_tokens} new tokens, EOS ignored, decode time only")
    print("| prompt | plain tok/s | speculative tok/s | speed-up | acceptance | tokens/forward |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        s = r["speculative"]
        print(f"| {name} | {r['plain']['decode_tok_s']:.1f} | {s['decode_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{s['acceptance']:.2f} | {s['tokens_per_forward']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
