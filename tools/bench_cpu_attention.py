"""The CPU decode attention op's AVX2 and AVX-512 loops, side by side, on the default model's heads.

One layer of SmolLM2-135M (9 query heads over 3 KV heads, head_dim 64), blocks of 16 in shuffled
order, contexts a few tokens apart so sequences end mid-block. Per (sequences, context) case the
two loops take turns for --rounds rounds of --calls calls each; printed: the fastest tenth and
the median of each loop's calls in microseconds, and the KV bytes read per second at the fastest
tenth (the cache's rate: a long context is bound by it).

    python tools/bench_cpu_attention.py [--cases 16x100,16x300,1x300,1x2048,4x1024]
                                        [--kv-dtype fp16|bf16|fp32] [--rounds 2] [--calls 1000]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import call_times, fastest_tenth  # noqa: E402

from kernels import cpu_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def case_inputs(seqs: int, context: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    blocks = seqs * per_seq + 1
    k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    tables = (torch.randperm(blocks - 1, generator=g)[: seqs * per_seq].int() + 1).view(seqs, per_seq)
    lens = torch.tensor([max(1, context - 7 * (i % 5)) for i in range(seqs)], dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=g)
    return q, k, v, tables, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="16x100,16x300,1x300,1x2048,4x1024",
                        help="sequences x context, comma-separated")
    parser.add_argument("--kv-dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    if not cpu_ops.available():
        sys.exit("the C++ CPU ops do not build here")
    isas = [isa for isa in ("avx2", "avx512") if cpu_ops.attention_isa_supported(isa)]
    dtype = DTYPES[args.kv_dtype]
    print(f"{torch.get_num_threads()} threads, {args.kv_dtype} cache, {HEADS} q / {KV_HEADS} KV heads, "
          f"head_dim {HEAD_DIM}; us per layer, fastest tenth / median (KV GB/s at the fastest tenth)")
    print(f"{'case':>8} {'round':>5} " + " ".join(f"{isa:>24}" for isa in isas))
    with torch.inference_mode():
        for case in args.cases.split(","):
            seqs, context = (int(x) for x in case.split("x"))
            inputs = case_inputs(seqs, context, dtype)
            k, lens = inputs[1], inputs[4]
            kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * k.element_size()
            for r in range(args.rounds):
                cells = []
                for isa in isas:
                    call = functools.partial(cpu_ops.paged_decode_attention, *inputs, 0.125, isa)
                    times = [t * 1e6 for t in call_times(call, args.calls, warmup=20)]
                    fast = fastest_tenth(times)
                    cells.append(f"{fast:7.1f} / {statistics.median(times):7.1f} ({kv_bytes / fast / 1e3:4.1f})")
                print(f"{case:>8} {r:>5} " + " ".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
