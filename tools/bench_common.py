"""Helpers the benchmarks share: device copy bandwidth (the yardstick the GPU benchmarks' "% of
copy bandwidth" columns divide by), timed runs of calls, comma-separated integer flags, table
cells, and starting a server to measure (a free port, waiting for its health check)."""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

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


def call_times(fn: Callable[[], object], calls: int, warmup: int = 3) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn`` in a row, after ``warmup`` untimed ones;
    fastest first."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)


def fastest_tenth(times: list[float]) -> float:
    """The fastest tenth's bound of ascending ``times``: on a shared machine steadier than the
    median, whose calls the host's other tenants slow by chance."""
    return times[len(times) // 10]


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 300, log: Path | None = None) -> None:
    """Until ``url`` answers 200; RuntimeError (with the end of ``log``) if the server exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None else ""
            raise RuntimeError(f"server exited with {process.returncode} before answering {url}: {tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {timeout_s} s")
