"""CPU steps run on the cores other programs leave (edgeinfer.worker.cpu_share)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from edgeinfer.worker import cpu_share
from edgeinfer.worker.cpu_share import CpuShare, busy_cpu_seconds, threads_for

STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 100 5 50 2000 7 1 2 3 0 0
cpu1 200 0 60 2500 3 0 0 40 0 0
cpu2 999 0 0 0 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_threads_for_gives_up_a_core_per_busy_share_above_the_slack() -> None:
    assert threads_for(0.0, 2) == 2
    assert threads_for(0.25, 2) == 2  # kernel threads, a terminal: within the slack
    assert threads_for(0.5, 2) == 1  # a core shared half the time stalls its partner at each barrier
    assert threads_for(1.0, 2) == 1
    assert threads_for(3.0, 2) == 1  # never below one
    assert threads_for(1.2, 8) == 7  # one core taken, the next 20%: within the slack
    assert threads_for(1.5, 8) == 6
    assert threads_for(0.0, 1) == 1


def test_busy_seconds_are_the_allowed_cores_busy_ticks_with_steal() -> None:
    """user + nice + system + irq + softirq + steal of the listed cores; idle, iowait, the
    all-cores line and other cores left out."""
    hz = os.sysconf("SC_CLK_TCK")
    assert busy_cpu_seconds(STAT, {0}) == pytest.approx((100 + 5 + 50 + 1 + 2 + 3) / hz)
    assert busy_cpu_seconds(STAT, {0, 1}) == pytest.approx((161 + 200 + 60 + 40) / hz)
    assert busy_cpu_seconds(STAT, {5}) == 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.busy = 0.0  # cpu-seconds of every program on our cores
        self.own = 0.0  # ours alone

    def advance(self, seconds: float, ours: float, others: float) -> None:
        """``seconds`` pass with this process on ``ours`` cores and other programs on ``others``."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def test_share_follows_other_programs_in_windows() -> None:
    c, calls = Clock(), []
    share = CpuShare(read_busy=lambda: c.busy, own_cpu=lambda: c.own, clock=lambda: c.now,
                     set_threads=calls.append, get_threads=lambda: 2)
    assert share.adjust() == 2  # the first call only takes the baseline
    c.advance(0.3, ours=2.0, others=0.1)
    assert share.adjust() == 2 and calls == []
    c.advance(0.3, ours=1.4, others=0.6)  # a busy program came
    assert share.adjust() == 1 and calls == [1]
    c.advance(0.1, ours=1.0, others=1.0)
    assert share.adjust() == 1  # inside the window: not measured again
    c.advance(0.3, ours=1.0, others=1.0)  # still there: one thread, the other core is its
    assert share.adjust() == 1 and calls == [1]
    c.advance(0.3, ours=1.0, others=0.05)  # gone
    assert share.adjust() == 2 and calls == [1, 2]


def test_a_window_that_spans_an_idle_spell_is_not_judged() -> None:
    """After the engine was idle, the load averaged since its last step is history: the first
    step keeps its threads and starts a new window, which is judged as usual."""
    c, calls = Clock(), []
    share = CpuShare(read_busy=lambda: c.busy, own_cpu=lambda: c.own, clock=lambda: c.now,
                     set_threads=calls.append, get_threads=lambda: 2)
    share.adjust()
    c.advance(0.3, ours=2.0, others=0.0)
    assert share.adjust() == 2
    c.advance(5.0, ours=0.0, others=1.5)  # idle; another program ran, then stopped
    assert share.adjust() == 2 and calls == []
    c.advance(0.3, ours=2.0, others=0.0)
    assert share.adjust() == 2 and calls == []
    c.advance(5.0, ours=0.0, others=0.0)  # idle again; now a program is busy
    assert share.adjust() == 2
    c.advance(0.3, ours=1.0, others=1.0)
    assert share.adjust() == 1 and calls == [1]


def test_share_keeps_the_configured_threads_without_proc_stat() -> None:
    calls: list[int] = []
    share = CpuShare(read_busy=lambda: None, set_threads=calls.append, get_threads=lambda: 2)
    assert [share.adjust() for _ in range(3)] == [2, 2, 2] and calls == []


@pytest.mark.skipif(cpu_share.read_busy_cpu_seconds() is None or not 1 < len(os.sched_getaffinity(0)) <= 8,
                    reason="needs /proc/stat and 2 to 8 cores to fill")
def test_busy_loops_on_every_core_leave_one_thread_and_their_end_gives_the_cores_back() -> None:
    """Real busy processes, one per core this process may use, measured through /proc/stat."""
    cores = len(os.sched_getaffinity(0))
    calls: list[int] = []
    share = CpuShare(set_threads=calls.append, get_threads=lambda: cores)
    share.adjust()
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.7)  # the window (within cpu_share.STALE_S): the interpreters start, then spin
        assert share.adjust() == 1
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    # Back to every core once a window passes without them (polled: other work on a shared
    # machine, a compiler or another test run, may hold a core for a while).
    deadline = time.monotonic() + 10.0
    while share.adjust() != cores and time.monotonic() < deadline:
        time.sleep(0.3)
    assert share.threads == cores
    assert calls[0] == 1 and calls[-1] == cores


@pytest.mark.skipif(cpu_share.read_busy_cpu_seconds() is None or not 1 < len(os.sched_getaffinity(0)) <= 8,
                    reason="needs /proc/stat and 2 to 8 cores to fill")
def test_the_engine_decodes_on_the_cores_left(default_model_path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """An engine from a model file (RuntimeConfig.share_cpu, the default) drops to one thread
    while busy programs hold every core, and still answers."""
    import anyio

    from edgeinfer.config import RuntimeConfig
    from edgeinfer.core.events import Finished
    from edgeinfer.core.request import GenerateRequest
    from edgeinfer.core.sampling_params import SamplingParams
    from edgeinfer.engine.api import Engine, EngineConfig

    async def main() -> Finished:
        async with Engine(EngineConfig(str(default_model_path), RuntimeConfig(num_kv_blocks=16))) as engine:
            loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                     for _ in os.sched_getaffinity(0)]
            try:
                request = GenerateRequest("r", prompt="Once upon a time",
                                          params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
                events = [e async for e in engine.generate(request)]
            finally:
                for loop in loops:
                    loop.kill()
                    loop.wait()
            return events[-1]

    with caplog.at_level("WARNING", logger="edgeinfer.worker.cpu_share"):
        last = anyio.run(main)
    assert isinstance(last, Finished) and last.usage.completion_tokens == 64
    assert "CPU steps now run on 1 thread" in caplog.text


def test_only_a_cpu_model_actor_shares_and_a_restart_keeps_its_share() -> None:
    """A restarted actor keeps the CpuShare that knows the configured threads (a fresh one would
    take a lowered count as the configuration); fake runners, not CPU models, get none."""
    from fake_runner import FakeRunner

    from edgeinfer.config import ModelConfig
    from edgeinfer.engine.model_actor import ModelActor
    from edgeinfer.models.llama import LlamaModel
    from edgeinfer.models.synthetic import synthetic_model
    from edgeinfer.worker.model_runner import ModelRunner
    from kernels.dispatch import choose_backend
    from kernels.kv_pool import KVPool

    tiny = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position=128)
    loaded = synthetic_model(tiny, "int8", group_size=32, seed=1)
    model = LlamaModel(loaded.config, dict(loaded.weights), choose_backend("reference"))
    runner = ModelRunner(model, KVPool(2, 4, 4, 2, 16, "fp32", "fp32", "cpu"), 4)
    actor = ModelActor(runner, 64, (1,), share_cpu=True)
    try:
        assert actor._cpu_share is not None
        assert actor.restarted()._cpu_share is actor._cpu_share
        assert ModelActor(runner, 64, (1,))._cpu_share is None  # share_cpu off
        assert ModelActor(FakeRunner(4, 4), 64, (1,), share_cpu=True)._cpu_share is None
    finally:
        actor.close()
