"""The CPU decode attention op's AVX2 and AVX-512 loops, side by side, on the default model's heads.

One layer of SmolLM2-135M (9 query heads over 3 KV heads, head_dim 64), blocks of 16 in shuffled
order, contexts a few tokens apart so sequences end mid-block. Per (sequences, context) case the
two loops take turns for --rounds rounds of --calls calls each; printed: the fastest tenth and
the median of each loop's calls in microseconds, and the KV bytes read per second at the fastest
tenth (the cache's rate: a long context is bound by it).

--ordered lays each sequence's blocks out in table order (the pool's shuffle is the default).
--layers L gives each call the next of L caches in turn, as a decode step's 30 layers do: with
the default 1 the one cache stays in the CPU's caches from call to call (16 x 300 tokens of fp16
are 7.4 MB), while a step of the model reads its layers' caches from memory.

    python tools/bench_cpu_attention.py [--cases 16x100,16x300,1x300,1x2048,4x1024]
                                        [--kv-dtype fp16|bf16|fp32|int8|int4] [--rounds 2] [--calls 1000]
                                        [--layers 30] [--ordered] [--isa avx512]

int8 caches carry an fp16 scale per token and head, int4 ones two codes per byte and an fp16
scale and zero per 32 channels (their bytes, scales included, count in the GB/s).
"""

from __future__ import annotations

import argparse
import functools
import itertools
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
KV_DTYPES = (*DTYPES, "int8", "int4")


def case_inputs(seqs: int, context: int, kv_dtype: str, seed: int = 0,
                ordered: bool = False) -> tuple[tuple, tuple, int]:
    """(q, k, v, tables, lens), the caches' scales (and zeros), and a token's K + V bytes per KV head."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    blocks = seqs * per_seq + 1
    shape = (blocks, BLOCK, KV_HEADS)
    order = torch.arange(blocks - 1) if ordered else torch.randperm(blocks - 1, generator=g)
    tables = (order[: seqs * per_seq].int() + 1).view(seqs, per_seq)
    lens = torch.tensor([max(1, context - 7 * (i % 5)) for i in range(seqs)], dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=g)
    if kv_dtype in DTYPES:
        k, v = (torch.randn(*shape, HEAD_DIM, generator=g).to(DTYPES[kv_dtype]) for _ in "kv")
        return (q, k, v, tables, lens), (), 2 * HEAD_DIM * k.element_size()
    if kv_dtype == "int8":
        k, v = (torch.randint(-127, 128, (*shape, HEAD_DIM), generator=g, dtype=torch.int8) for _ in "kv")
        scales = tuple((torch.rand(*shape, generator=g) * 0.02).half() for _ in "kv")
        return (q, k, v, tables, lens), scales, 2 * (HEAD_DIM + 2)
    k, v = (torch.randint(0, 256, (*shape, HEAD_DIM // 2), generator=g, dtype=torch.uint8) for _ in "kv")
    params = tuple((torch.rand(*shape, HEAD_DIM // 32, generator=g) * 0.2).half() for _ in range(4))  # scales, zeros
    return (q, k, v, tables, lens), params, 2 * (HEAD_DIM // 2 + HEAD_DIM // 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="16x100,16x300,1x300,1x2048,4x1024",
                        help="sequences x context, comma-separated")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=1, help="caches called in turn (default: 1, see above)")
    parser.add_argument("--ordered", action="store_true", help="blocks in table order instead of shuffled")
    parser.add_argument("--isa", choices=("avx2", "avx512"), action="append",
                        help="only these loops (repeatable; default: every one this CPU runs), e.g. under perf")
    args = parser.parse_args()
    if not cpu_ops.available():
        sys.exit("the C++ CPU ops do not build here")
    isas = [isa for isa in ("avx2", "avx512") if cpu_ops.attention_isa_supported(isa) and isa in (args.isa or [isa])]
    if not isas:
        sys.exit(f"this CPU runs none of {args.isa}")
    print(f"{torch.get_num_threads()} threads, {args.kv_dtype} cache, {HEADS} q / {KV_HEADS} KV heads, "
          f"head_dim {HEAD_DIM}; us per layer, fastest tenth / median (KV GB/s at the fastest tenth)")
    print(f"{'case':>8} {'round':>5} " + " ".join(f"{isa:>24}" for isa in isas))
    with torch.inference_mode():
        for case in args.cases.split(","):
            seqs, context = (int(x) for x in case.split("x"))
            layers = [case_inputs(seqs, context, args.kv_dtype, seed, args.ordered) for seed in range(args.layers)]
            kv_bytes = int(layers[0][0][4].sum()) * KV_HEADS * layers[0][2]
            for r in range(args.rounds):
                cells = []
                for isa in isas:
                    turn = itertools.cycle([functools.partial(cpu_ops.paged_decode_attention, *inputs, 0.125, isa,
                                                              *quant) for inputs, quant, _ in layers])
                    call = functools.partial(lambda turn: next(turn)(), turn)
                    times = [t * 1e6 for t in call_times(call, args.calls, warmup=20)]
                    fast = fastest_tenth(times)
                    cells.append(f"{fast:7.1f} / {statistics.median(times):7.1f} ({kv_bytes / fast / 1e3:4.1f})")
                print(f"{case:>8} {r:>5} " + " ".join(f"{c:>24}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
