"""Helpers the GPU benchmarks share: device copy bandwidth (the yardstick their "% of copy
bandwidth" columns divide by), comma-separated integer flags and table cells."""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth(device: torch.device | str = "cuda", num_bytes: int = 1 << 30) -> float:
    """Bytes per second of a same-device copy of ``num_bytes``, read plus write counted: the
    median of triton's do_bench on CUDA, of 10 timed copies after 2 warm-ups elsewhere."""
    device = torch.device(device)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
        return 2 * num_bytes / (ms * 1e-3)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * num_bytes / statistics.median(times[2:])


def int_list(text: str) -> list[int]:
    """argparse type for "1,8,32"."""
    return [int(x) for x in text.split(",") if x]


def table_cell(value: object) -> str:
    """A number as a table shows it: 3 significant digits below 100, whole numbers above."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
