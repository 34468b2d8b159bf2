"""Perplexity of the default model per KV-cache format, on a fixed slice of tinyshakespeare.

Weights run on the exact fp32 reference path so only the KV format changes between rows; every
window's attention reads its keys and values back from the (quantized) pool. Targets: int8 KV
within +0.5% of the bf16 KV figure, int4 within +3%.

    python tools/kv_quality.py [--tokens 4096] [--window 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgeinfer.models.llama import LlamaModel  # noqa: E402
from edgeinfer.models.loader import load_model  # noqa: E402
from edgeinfer.models.pull import default_model_path, pull  # noqa: E402
from edgeinfer.worker.kv_calibration import calibration_ids  # noqa: E402
from kernels.dispatch import choose_backend  # noqa: E402
from quant.perplexity import model_perplexity, text_tokens  # noqa: E402

CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
FORMATS = [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("int8", "int8"), ("int8", "int4"),
           ("int4", "int4")]
TARGETS = {"int8/int8": 0.5, "int4/int4": 3.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = args.model or (default_model_path() if default_model_path().is_file() else pull())
    loaded = load_model(path)
    model = LlamaModel(loaded.config, loaded.weights, choose_backend("reference"),
                       kv_calibration_ids=calibration_ids(loaded.tokenizer))
    token_ids = text_tokens(loaded.tokenizer, CORPUS, args.tokens)
    rows = {}
    for k_dtype, v_dtype in FORMATS:
        start = time.perf_counter()
        result = model_perplexity(model, loaded.tokenizer, token_ids, args.window, k_dtype, v_dtype)
        rows[f"{k_dtype}/{v_dtype}"] = {"perplexity": result.perplexity, "seconds": time.perf_counter() - start}
    # The same int4 cache without the key transforms (no centring, identity rotation): what they
    # buy on the real model. Measured here, not asserted in a test: the gain is a few percent of
    # perplexity and moves with the CPU's fp32 summation order.
    bare = LlamaModel(loaded.config, loaded.weights, choose_backend("reference"))
    bare._kv_rotation = torch.eye(loaded.config.head_dim)
    start = time.perf_counter()
    result = model_perplexity(bare, loaded.tokenizer, token_ids, args.window, "int4", "int4")
    rows["int4/int4 untransformed"] = {"perplexity": result.perplexity, "seconds": time.perf_counter() - start}
    base = rows["bf16/bf16"]["perplexity"]
    for row in rows.values():
        row["vs_bf16_pct"] = 100 * (row["perplexity"] / base - 1)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{len(token_ids)} tokens of {CORPUS.name} in windows of {args.window}, fp32 reference weights")
    print("| K / V format | perplexity | vs bf16 KV | target |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else f"<= +{target}%: {'met' if row['vs_bf16_pct'] <= target else 'MISSED'}"
        print(f"| {name} | {row['perplexity']:.4f} | {row['vs_bf16_pct']:+.2f}% | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
