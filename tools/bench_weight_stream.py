"""How fast the a8 GEMM kernels stream weights from DRAM, against a plain read of the same memory.

A decode step of a model larger than the last-level cache reads every weight byte from DRAM once
per token: at one or two activation rows the kernel's speed is its weight bandwidth. This cycles
through enough distinct weights of one 1.7B-shaped linear (--mb, default 500 MB, past this
machine's 300 MB L3) that no call finds its weight cached, and prints GB/s per round for the a8
kernel (kernels.cpu_a8, int8x2 activations by default) beside torch's sum over a 1 GB fp32
tensor on the same threads (the reference read bandwidth). Formats: int4 g32 with fp16 scales
and mins (GGUF Q4_K / Q4_1), int8 g16 (Q6_K), int8 g32 (Q8_0).

    python tools/bench_weight_stream.py [--formats q4k q6k q8_0] [--m 1] [--terms 2] [--mb 500] [--rounds 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from kernels import cpu_a8, cpu_ops  # noqa: E402
from quant.formats import QuantizedTensor, quantize_int4, quantize_int8  # noqa: E402

# name -> (format, N, K, group): the 1.7B model's gate (Q4_K) and down (Q6_K / Q8_0) shapes
FORMATS = {"q4k": ("int4", 8192, 2048, 32), "q6k": ("int8", 2048, 8192, 16), "q8_0": ("int8", 2048, 8192, 32)}


def _weight(fmt: str, n: int, k: int, group: int, terms: int, seed: int) -> cpu_a8.A8Weight:
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "int4":
        w = quantize_int4(dense, group)
        w = QuantizedTensor("int4", w.shape, group, w.qweight, w.scales.half(), w.mins.half())
    else:
        w = quantize_int8(dense, group)
        w = QuantizedTensor("int8", w.shape, group, w.qweight, w.scales.half())
    return cpu_a8.prepare_a8(w, terms=terms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=["q4k", "q6k"])
    parser.add_argument("--m", type=int, default=1, help="activation rows (default: 1, a decode step)")
    parser.add_argument("--terms", type=int, choices=(1, 2), default=2, help="int8 activation terms (2: int8x2)")
    parser.add_argument("--mb", type=int, default=500, help="weight bytes cycled through (default: 500 MB)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not cpu_ops.available():
        sys.exit("the C++ CPU ops are not available on this machine")
    torch.set_num_threads(args.threads)
    print(f"a8 kernel ({cpu_a8.default_isa()}), M={args.m}, {args.terms} term(s), {args.threads} threads; "
          "GB/s per round")
    for name in args.formats:
        fmt, n, k, group = FORMATS[name]
        first = _weight(fmt, n, k, group, args.terms, 0)
        weights = [first] + [_weight(fmt, n, k, group, args.terms, s)
                             for s in range(1, max(1, args.mb * 10**6 // first.nbytes))]
        total = sum(w.nbytes for w in weights)
        x = torch.randn(args.m, k)
        rates = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for w in weights:
                cpu_a8.a8_linear(x, w)
            rates.append(total / (time.perf_counter() - start) / 1e9)
        print(f"{name} {n}x{k} ({len(weights)} weights, {total / 1e6:.0f} MB): " + " ".join(f"{r:.1f}" for r in rates))
    print("torch sum, 1 GB fp32: " + " ".join(f"{r:.1f}" for r in sum_rates(args.rounds)))


def sum_rates(rounds: int) -> list[float]:
    """GB/s of torch's sum over 1 GB of fp32 on the current threads, per round: the reference read
    rate (tools/bench_engine_step.py states a step's weight reads against the best)."""
    dense = torch.ones(256 * 1024 * 1024)
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        dense.sum()
        rates.append(dense.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return rates


if __name__ == "__main__":
    main()
