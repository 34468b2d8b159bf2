"""Benchmark paged decode attention on a GPU: time, bandwidth, and speed-up over fp16 SDPA.

Llama-8B attention (32 q heads, 8 KV heads, head_dim 128), one layer, block size 16, blocks in
shuffled order. For each KV dtype, batch and context length it reports the kernel time, the KV
bytes read (scales included) per second as a share of the measured device copy bandwidth, and
the ratio to torch SDPA (flash) over contiguous fp16 K/V of the same lengths. Targets: >= 80% of
copy bandwidth from 16k tokens; at 32k, int8 >= 1.7x and int4 >= 2.8x faster than fp16 SDPA.

    python tools/bench_attention.py [--batch 1,8,32] [--context 1024,4096,16384,32768]
                                    [--kv-dtypes fp16,int8,int4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from tools.bench_common import copy_bandwidth, int_list  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def bench_one(kv_dtype: str, batch: int, context: int, copy_bw: float) -> dict:
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.kv_pool import KVPool, kv_bytes_per_token
    from kernels.paged_attention import paged_decode_attention

    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    pool = KVPool(1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, kv_dtype, kv_dtype, "cuda")
    block_ids = torch.randperm(num_blocks, device="cuda", dtype=torch.int64)
    tables = block_ids.view(batch, blocks_per_seq).to(torch.int32)
    chunk = 1 << 18  # write the pool in chunks of tokens to bound the temporary K/V
    slots = (block_ids.view(-1, 1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device="cuda")).flatten()
    for start in range(0, slots.numel(), chunk):
        part = slots[start:start + chunk]
        kv = torch.randn(2, part.numel(), NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
        pool.write(0, kv[0], kv[1], part, use_triton=True)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    scale = HEAD_DIM**-0.5
    ms = triton.testing.do_bench(lambda: paged_decode_attention(
        q, pool, 0, tables, context_lens, scale, use_triton=True, max_context_len=context))

    # Baseline: flash SDPA over contiguous fp16 K/V; the g q heads of a KV head are its g "rows".
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    qg = q.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_ms = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qg, k, v, scale=scale))

    num_bytes = batch * context * kv_bytes_per_token(1, NUM_KV_HEADS, HEAD_DIM, kv_dtype, kv_dtype)
    bandwidth = num_bytes / (ms * 1e-3)
    return {
        "kv_dtype": kv_dtype, "batch": batch, "context": context, "time_us": ms * 1e3,
        "gbps": bandwidth / 1e9, "pct_copy_bw": 100 * bandwidth / copy_bw,
        "sdpa_fp16_us": sdpa_ms * 1e3, "speedup_vs_sdpa": sdpa_ms / ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int_list, default=[1, 8, 32])
    parser.add_argument("--context", type=int_list, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--kv-dtypes", type=lambda s: s.split(","), default=["fp16", "int8", "int4"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU; nothing to measure on this machine.")
        return 0
    copy_bw = copy_bandwidth()
    rows = []
    for kv_dtype in args.kv_dtypes:
        for batch in args.batch:
            for context in args.context:
                rows.append(bench_one(kv_dtype, batch, context, copy_bw))
                torch.cuda.empty_cache()
                if not args.json:
                    r = rows[-1]
                    print(f"{r['kv_dtype']:>5} b={r['batch']:>3} ctx={r['context']:>6}  "
                          f"{r['time_us']:9.1f} us  {r['gbps']:7.1f} GB/s  {r['pct_copy_bw']:5.1f}% copy  "
                          f"sdpa fp16 {r['sdpa_fp16_us']:9.1f} us  x{r['speedup_vs_sdpa']:.2f}", flush=True)
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "copy_bw_gbps": copy_bw / 1e9,
                          "rows": rows}, indent=1))
    else:
        print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
