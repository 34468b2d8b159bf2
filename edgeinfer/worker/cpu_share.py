"""How many threads the CPU steps run on while other programs share the cores.

A CPU step is a few hundred short OpenMP parallel regions (the fused C++ step's GEMMs,
attention and norms, torch's ops), each ending at a barrier where libgomp's threads spin
(300,000 times by default) before they sleep. When another program keeps one of our cores busy,
our thread there is descheduled mid-region and its partner spins through time slices at every
barrier. Measured on the 2-vCPU development machine (default model, `edgeinfer bench`, 2 threads,
busy loops beside it): decode 113 tok/s alone, 27.7 beside one busy loop, 0.8 beside two; on one
thread, 85.1 and 42.8. A desktop daemon shares its cores with whatever the user runs.

CpuShare, which the model actor calls before each CPU step, reads how busy the cores this
process may run on were over the last quarter second (/proc/stat, a hypervisor's steal time
included), takes away this process's own CPU time, and runs the steps on the cores the rest
leaves free: at least one, at most the threads configured. After the engine was idle for a while
(STALE_S) the first step keeps the thread count and only starts a new window: averaged over the
idle time, the load said nothing about now (beside a benchmark's other server, whose rounds fell
in the idle time, the next round started on one thread). A lower libgomp spin count
(GOMP_SPINCOUNT=1000) was measured as the alternative: 38 tok/s beside two busy loops, but
10-15% slower on an idle machine (docs/BENCHMARKS.md, "Sharing the CPU").
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

WINDOW_S = 0.25  # how often the share is measured: /proc/stat counts in 10 ms ticks
# A baseline older than this dates from before the engine went idle: the load it averages is
# history (another program's burst that has ended), so the window starts afresh instead.
STALE_S = 4 * WINDOW_S
SLACK = 0.3  # cores of other work tolerated (kernel threads, a terminal) before a thread is given up
PROC_STAT = Path("/proc/stat")


def threads_for(others: float, max_threads: int) -> int:
    """Threads to run on when other programs keep ``others`` cores busy: the cores they leave,
    counting any share above SLACK as a whole core (a thread descheduled part of the time stalls
    its partner at every barrier), at least one."""
    return max(1, min(max_threads, max_threads - math.ceil(others - SLACK)))


def busy_cpu_seconds(stat: str, cpus: set[int]) -> float:
    """CPU-seconds the cores ``cpus`` have spent busy since boot, from /proc/stat's text: user,
    nice, system, irq, softirq and steal ticks (not idle or iowait; guest time is inside user)."""
    ticks = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def read_busy_cpu_seconds() -> float | None:
    """busy_cpu_seconds of the cores this process may run on; None where /proc/stat is not."""
    try:
        return busy_cpu_seconds(PROC_STAT.read_text(), os.sched_getaffinity(0))
    except (OSError, ValueError):
        return None


class CpuShare:
    """Adjusts the calling thread's torch (OpenMP) thread count to the cores other programs
    leave; call ``adjust`` on the thread that runs the steps, before each step."""

    def __init__(self, read_busy: Callable[[], float | None] = read_busy_cpu_seconds,
                 own_cpu: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads) -> None:
        self._read_busy, self._own_cpu, self._clock = read_busy, own_cpu, clock
        self._set_threads, self._get_threads = set_threads, get_threads
        self.max_threads = 0  # the configured count, read on the first call (it is per thread)
        self.threads = 0
        self._measurable = True  # False where /proc/stat cannot be read: the configured threads stay
        self._last: tuple[float, float, float] | None = None  # (clock, busy cpu-s, own cpu-s)

    def adjust(self) -> int:
        """The threads the next step runs on, changed when the last window's share says so."""
        now = self._clock()
        if not self.max_threads:
            self.max_threads = self.threads = self._get_threads()
        if not self._measurable or self.max_threads == 1 or \
                (self._last is not None and now - self._last[0] < WINDOW_S):
            return self.threads
        busy = self._read_busy()
        if busy is None:
            self._measurable = False
            return self.threads
        own = self._own_cpu()
        if self._last is not None and now - self._last[0] <= STALE_S:
            then, busy_then, own_then = self._last
            others = max(0.0, (busy - busy_then) - (own - own_then)) / (now - then)
            wanted = threads_for(others, self.max_threads)
            if wanted != self.threads:
                (log.warning if wanted < self.threads else log.info)(
                    "other programs keep %.1f of the %d cores busy: CPU steps now run on %d thread%s",
                    others, self.max_threads, wanted, "" if wanted == 1 else "s")
                self._set_threads(wanted)
                self.threads = wanted
        self._last = (now, busy, own)
        return self.threads
