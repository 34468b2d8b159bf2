"""This machine's int8 dot-product peak: vpdpbusd (or AMX tdpbssd) throughput in GOP/s on 1 and 2 threads.

The yardstick for the int8-activation GEMMs (kernels.cpu_a8; tools/bench_int8_gemm.py states
its figures as a fraction of it). A tiny C kernel (no memory traffic: 6-12 independent
accumulators so the instruction's latency is hidden, 64 or 32 byte-pairs each) is compiled with
the system C compiler into a temporary library and called through ctypes from one thread per
core (ctypes drops the GIL). One vpdpbusd on zmm is 64 multiply-adds = 128 ops. --isa avx2
measures vpmaddubsw + vpmaddwd + vpaddd, the AVX2 kernel's inner step, the same way; --isa amx
tdpbssd on four 16 x 16 int32 tiles (16 x 16 x 64 multiply-adds each), the tile data state asked
of the OS first as the kernel does.

    python tools/int8_peak.py [--isa amx|avx512vnni|avxvnni|avx2] [--seconds 0.5] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# (compiler flags, vector type, width prefix, step(acc, a, b), bytes per vector); one ISA per library.
_ISAS = {
    "amx": ("-mamx-tile -mamx-int8", "", "", "", 0),
    "avx512vnni": ("-mavx512f -mavx512bw -mavx512vnni", "__m512i", "_mm512",
                   "_mm512_dpbusd_epi32({acc}, {a}, {b})", 64),
    "avxvnni": ("-mavx2 -mavxvnni", "__m256i", "_mm256", "_mm256_dpbusd_avx_epi32({acc}, {a}, {b})", 32),
    "avx2": ("-mavx2", "__m256i", "_mm256",
             "_mm256_add_epi32({acc}, _mm256_madd_epi16(_mm256_maddubs_epi16({a}, {b}), ones))", 32),
}


# AMX: four C tiles in turn hide tdpbssd's latency; A and B stay loaded.
_AMX_SOURCE = """
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } config;
int64_t run(int64_t iterations, int seed) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1;
  config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 6; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
  int8_t a[16 * 64];
  int32_t out[16 * 16];
  memset(a, seed, sizeof a);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t it = 0; it < iterations; ++it) {
    _tile_dpbssd(0, 4, 5); _tile_dpbssd(1, 4, 5); _tile_dpbssd(2, 4, 5); _tile_dpbssd(3, 4, 5);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
"""


def _accumulators(isa: str) -> int:
    """Independent chains: 12 hide vpdpbusd's latency; AVX2 has 16 registers and 7 go to operands."""
    return 6 if isa == "avx2" else 12


def _source(isa: str) -> str:
    _, vec, width, step, _ = _ISAS[isa]
    zero = f"{width}_setzero_si{width[3:]}()"
    accs = range(_accumulators(isa))
    # Accumulator i multiplies a[i % 4] by b[i / 4]: a distinct operand pair each. AVX2's
    # vpmaddubsw does not read the accumulator, so a shared pair is one product to the compiler,
    # and accumulators that start alike and take the same products are one accumulator: with
    # b[i / 4 % 2] the 12 VNNI chains compiled to 8 vpdpbusd per iteration and the peak read 1.5x
    # too high (700 against 468 GOP/s on the AMD EPYC, 2026-11-27). The operands pass through an
    # empty asm per iteration, so no product leaves the loop.
    body = "\n".join(f"    acc{i} = {step.format(acc=f'acc{i}', a=f'a{i % 4}', b=f'b{i // 4}')};" for i in accs)
    operands = [f"a{j}" for j in range(4)] + [f"b{j}" for j in range((len(accs) + 3) // 4)]
    return f"""
#include <immintrin.h>
#include <stdint.h>
int64_t run(int64_t iterations, int seed) {{
  {vec} {", ".join(f"{v} = {width}_set1_epi8((char)(seed + {j}))" for j, v in enumerate(operands))};
  const {vec} ones = {width}_set1_epi16(1);  /* the AVX2 step's int16 -> int32 pair sum */
  {vec} {", ".join(f"acc{i} = {zero}" for i in accs)};
  for (int64_t it = 0; it < iterations; ++it) {{
{body}
    __asm__ volatile("" : {", ".join(f'"+v"({v})' for v in operands)});
  }}
  {vec} total = {zero};
  {" ".join(f"total = {width}_add_epi32(total, acc{i});" for i in accs)}
  int64_t out[sizeof(total) / 8];
  __builtin_memcpy(out, &total, sizeof(total));
  return out[0];
}}
"""


def _library(isa: str, folder: Path) -> ctypes.CDLL:
    flags = _ISAS[isa][0].split()
    source = folder / f"peak_{isa}.c"
    source.write_text(_AMX_SOURCE if isa == "amx" else _source(isa))
    library = folder / f"peak_{isa}.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", *flags, str(source), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.run.argtypes = [ctypes.c_int64, ctypes.c_int]
    lib.run.restype = ctypes.c_int64
    return lib


def peak_gops(isa: str, threads: int, seconds: float = 0.5, repeats: int = 3) -> float:
    """Sustained int8 multiply-add throughput (2 ops each) in GOP/s on ``threads`` threads: the
    best of ``repeats`` runs, since other work on the machine can only lower it."""
    with tempfile.TemporaryDirectory() as folder:
        lib = _library(isa, Path(folder))
        ops_per_iteration = 4 * 16 * 16 * 64 * 2 if isa == "amx" else _accumulators(isa) * _ISAS[isa][4] * 2
        if lib.run(100_000, 0) < 0:  # warm up (clock ramp, page-in); AMX: -1 when the OS refused the tile state
            raise RuntimeError("the OS did not grant this process the AMX tile state (arch_prctl)")
        t0 = time.perf_counter()
        lib.run(1_000_000, 0)
        iterations = max(1, int(1_000_000 * seconds / (time.perf_counter() - t0)))
        best = float("inf")
        for _ in range(repeats):
            workers = [threading.Thread(target=lib.run, args=(iterations, i)) for i in range(threads)]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t0)
    return threads * iterations * ops_per_iteration / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=list(_ISAS), default="avx512vnni")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = {"isa": args.isa, "gops_1_thread": peak_gops(args.isa, 1, args.seconds),
              "gops_2_threads": peak_gops(args.isa, 2, args.seconds)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.isa}: {result['gops_1_thread']:.0f} GOP/s on 1 thread, {result['gops_2_threads']:.0f} on 2")


if __name__ == "__main__":
    main()
