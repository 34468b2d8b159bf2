"""What sampling a decode step's tokens costs, per sampling setting, at 1 and 16 rows.

The logits are the default model's own, over tinyshakespeare (one 128-token prefill, a logits
row per position), so nuclei and top-k sets are as wide as a real step's, not a random row's.
Each setting's step, as the model actor takes it (SamplingBatch.from_params over rows of a
256-token prompt and 64 generated tokens, then `sample`: penalties, truncation, the draw), is
timed --calls times on rows drawn from those logits; the table gives the fastest tenth and the median,
ms, with --compare both the C++ ops (kernels/cpu/sampling.cpp) and the sampler's torch path
(its reference), alternated per setting: ``EDGEINFER_CPU_KERNEL`` is read once per process, so
the tool swaps the sampler's private ``_cpu_kernels`` choice (a measurement tool, not an API).
First, the selection ops alone: the head refinement's top-64 and greedy's argmax, C++ against
torch (torch.topk, max's indices).

    python tools/bench_sampler.py [--rows 1,16] [--calls 200] [--compare]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import call_times, fastest_tenth, int_list  # noqa: E402

from edgeinfer.config import RuntimeConfig  # noqa: E402
from edgeinfer.core.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.models.loader import load_model  # noqa: E402
from edgeinfer.models.pull import default_model_path  # noqa: E402
from edgeinfer.worker import sampler  # noqa: E402
from edgeinfer.worker.batch import SeqChunk, build_batch  # noqa: E402
from edgeinfer.worker.build import build_model  # noqa: E402
from kernels import cpu_ops  # noqa: E402
from kernels.kv_pool import KVPool  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
POSITIONS = 128
PROMPT, OUTPUT = 256, 64  # each row's history: what penalties count
SETTINGS = {  # name -> SamplingParams, the settings clients send most
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.8, top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature 0.7, top_k 40": SamplingParams(temperature=0.7, top_k=40),
    "top_k 40, top_p 0.9, min_p 0.05": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
    "top_p 0.9, repetition 1.1": SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1),
    "temperature 1, logprobs 5": SamplingParams(temperature=1.0, logprobs=5),
}


def model_logits() -> torch.Tensor:
    """(POSITIONS, vocab) fp32 logits of the default model over the corpus' opening."""
    loaded = load_model(str(default_model_path()))
    model = build_model(loaded, RuntimeConfig())
    ids = loaded.tokenizer.encode(CORPUS.read_text()[:4000])[:POSITIONS]
    block = 16
    pool = KVPool(model.config.num_layers, POSITIONS // block + 1, block, model.config.num_kv_heads,
                  model.config.head_dim, "fp16", "fp16", "cpu")
    chunk = SeqChunk(tuple(ids), 0, tuple(range(POSITIONS // block + 1)), num_logits=len(ids))
    with torch.inference_mode():
        return model.forward(*build_batch([chunk], block, "cpu"), pool).float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int_list, default=[1, 16], help="rows per call (default: 1,16)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--compare", action="store_true", help="also time the torch path, alternated")
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = model_logits()
    vocab = logits.shape[-1]
    generator = torch.Generator().manual_seed(0)
    paths = ("kernel", "torch") if args.compare else ("kernel",)
    on_cpu = sampler._cpu_kernels

    def torch_path(_: torch.Tensor) -> bool:
        return False

    print(f"selection over the default model's logits, {args.calls} calls, ms: fastest tenth / median")
    print("| op | rows | C++ (row_topk) | torch | torch / C++ (medians) |\n|---|---|---|---|---|")
    selections = (("the head's top-64", 64, lambda x: x.topk(64, dim=-1)),
                  ("greedy's argmax", 1, lambda x: x.max(dim=-1).indices))
    for name, k, torch_op in selections if cpu_ops.available() else ():
        for rows in args.rows:
            picked = logits[:rows].contiguous()
            ours = call_times(lambda: cpu_ops.row_topk(picked, k), args.calls)  # noqa: B023
            theirs = call_times(lambda: torch_op(picked), args.calls)  # noqa: B023
            print(f"| {name} | {rows} | {fastest_tenth(ours) * 1e3:.3f} / {statistics.median(ours) * 1e3:.3f} | "
                  f"{fastest_tenth(theirs) * 1e3:.3f} / {statistics.median(theirs) * 1e3:.3f} | "
                  f"{statistics.median(theirs) / statistics.median(ours):.1f}x |")
    print(f"\nsample() on the default model's logits ({logits.shape[0]} positions of tinyshakespeare), "
          f"{args.calls} calls, ms: fastest tenth / median; C++ ops here: {cpu_ops.available()}")
    print("| setting | rows | " + " | ".join(paths) + (" | torch / kernel |" if args.compare else " |"))
    print("|---|---|" + "---|" * (len(paths) + args.compare))
    for name, params in SETTINGS.items():
        for rows in args.rows:
            picked = logits[torch.randperm(logits.shape[0], generator=generator)[:rows]].contiguous()
            prompts = [tuple(torch.randint(vocab, (PROMPT,), generator=generator).tolist()) for _ in range(rows)]
            outputs = [tuple(torch.randint(vocab, (OUTPUT,), generator=generator).tolist()) for _ in range(rows)]

            def step(params: SamplingParams = params, picked: torch.Tensor = picked, prompts: list = prompts,
                     outputs: list = outputs) -> None:
                batch = sampler.SamplingBatch.from_params([params] * len(prompts), prompts, outputs, vocab, (2,),
                                                          generator=generator)
                sampler.sample(picked, batch)

            cells, medians = [], []
            for path in paths:
                sampler._cpu_kernels = on_cpu if path == "kernel" else torch_path
                times = call_times(step, args.calls)
                medians.append(statistics.median(times))
                cells.append(f"{fastest_tenth(times) * 1e3:.3f} / {medians[-1] * 1e3:.3f}")
            ratio = f" {medians[1] / medians[0]:.1f}x |" if args.compare else ""
            print(f"| {name} | {rows} | " + " | ".join(cells) + " |" + ratio)
    sampler._cpu_kernels = on_cpu
    return 0


if __name__ == "__main__":
    sys.exit(main())
