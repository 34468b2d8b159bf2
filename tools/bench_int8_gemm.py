"""The int8-activation GEMMs (kernels.cpu_a8) against the int16-activation kernel and fp32.

For SmolLM2-135M's two MLP shapes (gate/up-like N=1536 x K=576 and down-like N=576 x K=1536; or
--shapes 1.7b, SmolLM2-1.7B's 8192 x 2048 and 2048 x 8192) at
M = 1, 4, 16, 64, 256, prints microseconds per call and GOP/s (2 M N K / time) of: the a8 kernel
on each instruction set this CPU runs, the int16-activation kernel (kernels.cpu_ops, today's
path up to 64 rows) and torch's fp32 GEMM on the already dequantized weight (a lower bound for
today's dequantize + GEMM path above 64 rows), with the a8 figures also as a fraction of this
machine's int8 peak for their instruction set (tools/int8_peak.py, on the same threads), counting
the dot products of every term (with --terms 2 the kernel multiplies twice per weight). Each
runs --repeats calls in a row (the median counts); run it with nice, on a quiet machine.

    python tools/bench_int8_gemm.py [--format int4|int8] [--shapes 135m|1.7b] [--m 1 4 16 64 256] [--threads 2]
                                    [--repeats 15] [--terms 1|2]

--layer instead times one decode layer's four a8 GEMMs of the default model (qkv 960 x 576, o 576
x 576, gate/up 3072 x 576, down 576 x 1536, int4 g32, fp16 scales) in a row at each M on this
CPU's first int8 ISA, --repeats times, and prints the fastest tenth and the median: the figure
an A/B of the threading (two worktrees, alternated) reads on a noisy host. With --layers L each
call runs L layers' GEMMs, each layer its own weights (30 x 2.2 MB: more than the caches hold, so
they come from memory, as in a decode step), and prints the weights' read rate; --merged runs
the same bytes as two GEMMs (every layer's qkv, o and gate/up rows as one N x 576 weight, every
down as one N x 1536): what the kernel streams without a GEMM's start and end per 0.2-1.1 MB.
Each GEMM is one op call from Python; the call floor printed beside (a one-tile GEMM, cached)
is what the per-layer figure holds of that.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import call_times, fastest_tenth  # noqa: E402
from int8_peak import peak_gops  # noqa: E402

from kernels import cpu_a8, cpu_ops  # noqa: E402
from quant.formats import quantize_int4, quantize_int8  # noqa: E402

# (N, K) of the MLP's two linears: SmolLM2-135M's (the default model) and SmolLM2-1.7B's.
SHAPES = {"135m": {"1536x576": (1536, 576), "576x1536": (576, 1536)},
          "1.7b": {"8192x2048": (8192, 2048), "2048x8192": (2048, 8192)}}


def _median_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median microseconds per call of each function, each timed in its own run of calls: taking
    turns with 256-bit code, the AVX-512 kernel paid the core's AVX-512 power-up every call
    (M = 1: 48 us interleaved, 17 us in a run)."""
    return {name: statistics.median(call_times(fn, repeats)) * 1e6 for name, fn in fns.items()}


def _calls(x: torch.Tensor, a8: cpu_a8.A8Weight, isas: list[str], int16: Callable[[torch.Tensor], object],
           w_fp32: torch.Tensor, bf16: bool) -> dict[str, Callable[[], object]]:
    """The contenders for one input: the a8 kernel per ISA, bf16 on AMX-BF16 (where ``bf16``),
    the int16 kernel, fp32."""
    calls: dict[str, Callable[[], object]] = {isa: functools.partial(cpu_a8.a8_linear, x, a8, isa) for isa in isas}
    if bf16:
        calls[cpu_a8.BF16_ISA] = functools.partial(cpu_a8.a8_linear, x, a8, None, True)
    calls["int16"] = functools.partial(int16, x)
    calls["fp32"] = functools.partial(torch.matmul, x, w_fp32.t())
    return calls


LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # the default model's qkv, o, gate/up, down


def _a8_int4(n: int, k: int, seed: int, terms: int) -> cpu_a8.A8Weight:
    w = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), 32)
    return cpu_a8.prepare_a8(replace(w, scales=w.scales.half(), mins=w.mins.half()), terms)


def layer(ms: list[int], terms: int, repeats: int, layers: int, merged: bool) -> None:
    isa = next(isa for isa in cpu_a8.ISAS if cpu_a8.isa_supported(isa))
    if merged:  # the same bytes as two GEMMs: K = 576 rows of every layer, then every down
        wide = sum(n for n, k in LAYER_SHAPES if k == 576)
        weights = [_a8_int4(layers * wide, 576, 1, terms), _a8_int4(layers * 576, 1536, 2, terms)]
    else:
        weights = [_a8_int4(n, k, 1000 * layer + n, terms) for layer in range(layers) for n, k in LAYER_SHAPES]
    nbytes = sum(w.nbytes for w in weights)
    what = f"{layers} layers' GEMMs as two" if merged else f"{layers} layer(s)' GEMMs"
    for m in ms:
        calls = [functools.partial(cpu_a8.a8_linear, torch.randn(m, w.shape[1]), w, isa) for w in weights]
        times = call_times(lambda calls=calls: [call() for call in calls], repeats, warmup=20)
        fast = fastest_tenth(times)
        line = (f"{what}, M={m}, {terms} term(s), {isa}: fastest tenth {fast * 1e6:.0f} us, "
                f"median {statistics.median(times) * 1e6:.0f} us")
        if layers > 1:
            line += (f"; {fast / layers * 1e6:.0f} us a layer, weights {nbytes / 1e6:.1f} MB "
                     f"at {nbytes / fast / 1e9:.1f} GB/s")
        print(line)
    if layers > 1:
        tile = _a8_int4(16, 576, 3, terms)
        floor = call_times(functools.partial(cpu_a8.a8_linear, torch.randn(ms[0], 576), tile, isa), repeats, warmup=20)
        print(f"call floor (one 16 x 576 tile, M={ms[0]}, cached): {fastest_tenth(floor) * 1e6:.1f} us a GEMM call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["int4", "int8"], default="int4")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--terms", type=int, choices=(1, 2), default=1, help="int8 activation terms (2: int8x2)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="135m", help="whose MLP shapes (default: 135m)")
    parser.add_argument("--layer", action="store_true", help="one decode layer's four GEMMs (see above)")
    parser.add_argument("--layers", type=int, default=1, help="--layer: this many layers' weights a call (see above)")
    parser.add_argument("--merged", action="store_true", help="--layer: their bytes as two GEMMs (see above)")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    if (args.layers > 1 or args.merged) and not args.layer:
        parser.error("--layers and --merged go with --layer")
    if not cpu_ops.available():
        sys.exit("the C++ CPU ops do not build here")
    torch.set_num_threads(args.threads)
    if args.layer:
        layer(args.m, args.terms, args.repeats, args.layers, args.merged)
        return
    isas = [isa for isa in cpu_a8.ISAS if cpu_a8.isa_supported(isa)]
    bf16 = cpu_a8.isa_supported(cpu_a8.BF16_ISA)
    peaks = {isa: peak_gops(isa, args.threads) for isa in isas}
    print(f"{args.threads} threads, int8 kernels with {args.terms} term(s); int8 peak GOP/s: "
          + ", ".join(f"{isa} {p:.0f}" for isa, p in peaks.items()))
    print(f"{'shape':>9} {'M':>4} " + " ".join(f"{name:>20}" for name in [*isas, *[cpu_a8.BF16_ISA] * bf16,
                                                                             "int16", "fp32"])
          + f" {isas[0] + ' read':>10}")
    for label, (n, k) in SHAPES[args.shapes].items():
        dense = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
        weight = quantize_int4(dense, 32) if args.format == "int4" else quantize_int8(dense, 32)
        # fp16 scales and mins, as a GGUF's (Q4_1, Q8_0, the K-quants' products) are
        weight = replace(weight, scales=weight.scales.half(),
                         mins=None if weight.mins is None else weight.mins.half())
        a8 = cpu_a8.prepare_a8(weight, args.terms)
        if args.format == "int4":
            int16_weight = cpu_ops.prepare_int4(weight)
            int16 = cpu_ops.int4_linear
        else:
            int16_weight = cpu_ops.prepare_int8(weight)
            int16 = cpu_ops.int8_linear
        w_fp32 = weight.dequantize(torch.float32)
        for m in args.m:
            x = torch.randn(m, k)
            us = _median_us(_calls(x, a8, isas, functools.partial(int16, weight=int16_weight), w_fp32, bf16),
                            args.repeats)
            cells = []
            for name, t in us.items():
                gops = 2 * m * n * k / t / 1e3
                share = f" {gops * args.terms / peaks[name]:4.0%}" if name in peaks else "     "
                cells.append(f"{t:7.0f}us {gops:5.0f}G{share}")
            # At M = 1 a GEMV is bound by the weight's bytes: the a8 tiles' read rate.
            cells.append(f"{a8.nbytes / us[isas[0]] / 1e3:5.1f}GB/s")
            print(f"{label:>9} {m:>4} " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
