"""Benchmark the Triton W4A16 / W8A16 GEMM kernels on a CUDA GPU against the peers.

For each M and weight shape (N, K) it prints the kernel time, the effective weight bandwidth
(bytes of qweight + scales + mins per second), that as a share of the measured device copy
bandwidth, and speed-ups (peer time / our time, > 1 means we are faster) over cuBLAS fp16
``torch.mm``, torch's CUDA int4 kernel ``torch._weight_int4pack_mm`` (bf16 activations: the only
dtype it takes) and bitsandbytes ``matmul_4bit`` (nf4, blocksize 64) when importable. ``err`` is
the relative Frobenius error against the fp32 torch reference, so a wrong layout shows up.

Timing is triton.testing.do_bench (CUDA events, L2 flushed between runs, median); ``--cudagraph``
times through a CUDA graph instead (no launch overhead: what a graph-captured decode step sees).
On a machine without CUDA it says so and exits 0.

    python tools/bench_gemm.py [--json] [--cudagraph] [--dtype bf16] [--group 128] [--m 1,16]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from tools.bench_common import copy_bandwidth, table_cell  # noqa: E402

M_VALUES = (1, 4, 16, 64, 512)
SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 11008), (11008, 4096))  # (N, K)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _timer(cudagraph: bool) -> Callable[[Callable[[], object]], float]:
    import triton.testing

    def time_ms(fn: Callable[[], object]) -> float:
        fn()  # compile, and tune our kernels, before any graph capture
        torch.cuda.synchronize()
        if cudagraph:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    return time_ms


def _torch_int4(weight, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """torch's CUDA int4 kernel on the same codes: w = (q - 8) * s + z, so z = min + 8 * s."""
    from quant.formats import unpack_int4

    q = unpack_int4(weight.qweight).to(torch.int32)  # (N, K), 0..15
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # torch wants element 2j high
    try:
        w_packed = torch._convert_weight_to_int4pack(packed, 8)
    except RuntimeError:
        return None
    scales = weight.scales.t().float()  # (K // group, N)
    zeros = weight.mins.t().float() + 8 * scales
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).to(torch.bfloat16).contiguous()
    xb = x.to(torch.bfloat16)
    return lambda: torch._weight_int4pack_mm(xb, w_packed, weight.group_size, scales_and_zeros)


def _bnb_nf4(w: torch.Tensor, x: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    packed, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")
    return lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state)


def bench_shape(m: int, n: int, k: int, args: argparse.Namespace, time_ms, copy_gbs: float) -> list[dict]:
    from kernels.int4_gemm import int4_gemm, prepare_int4
    from kernels.int8_gemm import int8_gemm, prepare_int8
    from kernels.reference import int4_gemm_reference, int8_gemm_reference
    from quant.formats import quantize_int4, quantize_int8

    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w_mm = w.to(dtype)  # (N, K) row-major like nn.Linear: torch.mm(x, w_mm.t()) is cuBLAS
    t_fp16 = time_ms(lambda: torch.mm(x, w_mm.t()))
    rows = []
    for fmt in ("int4", "int8"):
        if fmt == "int4":
            qt = quantize_int4(w, args.group)
            qt = type(qt)("int4", qt.shape, qt.group_size, qt.qweight, qt.scales.half(), qt.mins.half())
            prepared, gemm, ref = prepare_int4(qt), int4_gemm, int4_gemm_reference
        else:
            qt = quantize_int8(w)  # per output channel
            qt = type(qt)("int8", qt.shape, qt.group_size, qt.qweight, qt.scales.half())
            prepared, gemm, ref = prepare_int8(qt), int8_gemm, int8_gemm_reference
        y = gemm(x, prepared)  # also tunes this shape
        y_ref = ref(x, qt).float()
        err = ((y.float() - y_ref).norm() / y_ref.norm()).item()
        t = time_ms(lambda p=prepared, g=gemm: g(x, p))
        gbs = qt.nbytes / t / 1e6
        row = {
            "fmt": fmt, "M": m, "N": n, "K": k, "us": 1e3 * t, "GB/s": gbs,
            "%copy": 100 * gbs / copy_gbs, "x_fp16": t_fp16 / t, "x_torch_int4": None, "x_bnb": None,
            "err": err,
        }  # fmt: skip
        if fmt == "int4":
            peer = _torch_int4(qt, x)
            if peer is not None:
                row["x_torch_int4"] = time_ms(peer) / t
            peer = _bnb_nf4(w.to(dtype), x)
            if peer is not None:
                row["x_bnb"] = time_ms(peer) / t
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--cudagraph", action="store_true", help="time through CUDA graphs")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16", help="activation dtype")
    parser.add_argument("--group", type=int, choices=(32, 64, 128), default=128, help="int4 group size")
    parser.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma-separated M values")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm needs a CUDA GPU (the Triton kernels only run interpreted on the CPU); skipping")
        return 0

    time_ms = _timer(args.cudagraph)
    copy_gbs = copy_bandwidth() / 1e9
    rows = []
    for n, k in SHAPES:
        for m in (int(v) for v in args.m.split(",")):
            rows += bench_shape(m, n, k, args, time_ms, copy_gbs)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "copy_GB/s": copy_gbs, "dtype": args.dtype,
                "int4_group": args.group, "cudagraph": args.cudagraph}  # fmt: skip
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return 0
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; activations {args.dtype}, "
          f"int4 group {args.group}, int8 per channel; x_* = peer time / our time")  # fmt: skip
    columns = list(rows[0])
    print("  ".join(f"{c:>12}" for c in columns))
    for row in rows:
        print("  ".join(f"{table_cell(row[c]):>12}" for c in columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
