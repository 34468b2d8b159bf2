"""The AVX2 quantized GEMMs (kernels/cpu/quantized_gemm.cpp) against the torch path each replaces.

For the default model's linear shapes (and its 49152 x 576 head) at several M, prints the
microseconds per call of the torch peer and of the C++ kernel, the ratio (torch / C++, > 1: ours
is faster) and the C++ kernel's weight bandwidth. --format int4 (default): random Q4-style
weights (fp16 scales and mins, group 32) against torch's ``_weight_int4pack_mm_for_cpu`` (bf16
activations, the fallback path); --format int8: Q8_0-style weights (fp16 scales, group 32)
against the bf16 GEMV that int8 weights ran as before the int8 kernel. The two run interleaved,
median of --repeats, so a noisy host shifts both alike.

    python tools/bench_cpu_kernels.py [--format int4|int8] [--m 1 4 16] [--threads 2] [--repeats 15] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from kernels import cpu_ops  # noqa: E402
from kernels.dispatch import PreparedLinear, _prepare_int4_cpu, linear  # noqa: E402
from quant.formats import QuantizedTensor, quantize_int4, quantize_int8  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def _peers(fmt: str, n: int, k: int) -> tuple[Callable[[torch.Tensor], object], Callable[[torch.Tensor], object], int]:
    """(torch peer, C++ kernel, the kernel's weight bytes) for a random weight of this shape."""
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    if fmt == "int4":
        w = quantize_int4(dense, 32)
        w = QuantizedTensor("int4", w.shape, 32, w.qweight, w.scales.half(), w.mins.half())
        ours4, theirs4 = cpu_ops.prepare_int4(w), _prepare_int4_cpu(w)
        return functools.partial(linear, weight=theirs4), functools.partial(cpu_ops.int4_linear, weight=ours4), \
            ours4.nbytes
    w = quantize_int8(dense, 32)
    ours = cpu_ops.prepare_int8(QuantizedTensor("int8", w.shape, 32, w.qweight, w.scales.half()))
    theirs = PreparedLinear("bf16_cpu", w.shape, None, dense=ours.dequantize(torch.bfloat16))
    return functools.partial(linear, weight=theirs), functools.partial(cpu_ops.int8_linear, weight=ours), ours.nbytes


def _time_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def run(fmt: str, ms: list[int], repeats: int) -> list[dict[str, float | str | int]]:
    rows = []
    for name, (n, k) in SHAPES.items():
        theirs, ours, nbytes = _peers(fmt, n, k)
        for m in ms:
            x = torch.randn(m, k)
            calls = max(1, int(2e5 // (n * max(m, 4))))  # ~ the same work per sample for every shape
            fns = {"torch": functools.partial(theirs, x), "cpp": functools.partial(ours, x)}
            for fn in fns.values():
                fn()
            samples: dict[str, list[float]] = {key: [] for key in fns}
            for _ in range(repeats):
                for key, fn in fns.items():
                    samples[key].append(_time_us(fn, calls))
            torch_us, cpp_us = (statistics.median(samples[key]) for key in ("torch", "cpp"))
            rows.append({"weight": f"{name} {n}x{k}", "m": m, "torch_us": round(torch_us, 1),
                         "cpp_us": round(cpp_us, 1), "speedup": round(torch_us / cpp_us, 2),
                         "cpp_gb_s": round(nbytes / cpp_us / 1e3, 1)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=("int4", "int8"), default="int4")
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not cpu_ops.available():
        print("the AVX2 CPU ops do not build or run on this machine; nothing to compare")
        return
    torch.set_num_threads(args.threads)
    rows = run(args.format, args.m, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    peer = "torch int4 kernel" if args.format == "int4" else "bf16 GEMV"
    print(f"{args.format} weights, {args.threads} threads, median of {args.repeats}; speed-up = {peer} / C++")
    print("| weight | M | torch us | C++ us | speed-up | C++ GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['weight']} | {r['m']} | {r['torch_us']} | {r['cpp_us']} | {r['speedup']}x | {r['cpp_gb_s']} |")


if __name__ == "__main__":
    main()
