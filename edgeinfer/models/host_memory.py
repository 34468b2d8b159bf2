"""How the process gives memory back to the OS (glibc's malloc; a no-op elsewhere).

torch's CPU allocator sits on malloc, so every tensor below the mmap threshold lives in the
heap, and freed space between live blocks stays resident: loading a model leaves ~70 MB of
such holes (each weight's staging copies freed between the prepared weights that stay).
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (absent outside glibc)
    except (OSError, AttributeError):
        return None
    return libc


def return_large_frees_to_the_os() -> None:
    """glibc raises its mmap threshold after large frees, so per-call prefill buffers (a
    dequantized weight, ~7 MB) then stay in the heap and RSS creeps up by ~100 MB. A fixed 1 MiB
    threshold returns them at once; measured: peak RSS of `bench` 492 -> 434 MB."""
    libc = _libc()
    if libc is not None:
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, 1 << 20)


def keep_step_buffers() -> None:
    """Once the models are loaded: buffers up to 64 MiB come from the heap and, freed, stay there
    for the next step (glibc's mmap and trim thresholds at 64 MiB; trim_heap, which the runner
    calls after prompt steps, still hands free pages back). Under the 1 MiB threshold a 16-row
    decode step's logits (3.1 MB) and the head's refined rows (2.4 MB) were each mapped, zeroed
    by the kernel page by page and unmapped every step: ~1,400 page faults a forward
    (docs/BENCHMARKS.md, "A one-row step's host work"). Loading keeps the 1 MiB threshold: a 1.7B
    model's staging copies left ~110 MB more peak RSS without it."""
    libc = _libc()
    if libc is not None:
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_trim_threshold, 64 << 20)
        libc.mallopt(m_mmap_threshold, 64 << 20)


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (malloc_trim: ~1 ms on a model-sized heap)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
