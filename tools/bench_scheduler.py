"""The scheduler's own cost per decode step (schedule + postprocess, no model), by context length.

--streams requests of each --contexts prompt length are prefilled in one step, then --steps decode
steps are planned and answered with made-up tokens (StepResult by hand, as the model actor would
send it), each timed from `schedule` to the end of `postprocess`: the host work a step pays on the
event loop for scheduling alone, which should not grow with the context (docs/BENCHMARKS.md).

    python tools/bench_scheduler.py [--streams 16] [--contexts 100 1000 4000 8000] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from edgeinfer.config import SchedulerConfig  # noqa: E402
from edgeinfer.core.messages import StepResult  # noqa: E402
from edgeinfer.core.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.core.scheduler import Scheduler  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 32_000


class Letters:
    """A detokenizer that costs nothing to speak of (the scheduler's own work is what is timed)."""

    def push(self, token_id: int) -> str:
        return chr(ord("a") + token_id % 26)


def step_times(streams: int, context: int, steps: int) -> list[float]:
    """Seconds per decode step (schedule + postprocess) of ``streams`` sequences after a ``context``-token prompt."""
    config = SchedulerConfig(max_num_seqs=streams, max_num_batched_tokens=streams * (context + 1), kv_watermark=0.0,
                             burst_window_s=0.0)
    blocks = streams * ((context + steps + BLOCK_SIZE) // BLOCK_SIZE + 1)
    scheduler = Scheduler(config, num_blocks=blocks, block_size=BLOCK_SIZE, max_model_len=context + steps + 8,
                          vocab_size=VOCAB, eos_token_ids=(2,), bytes_per_token=1, make_detokenizer=Letters)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(streams):  # distinct first tokens: no prefix shared
        scheduler.add_request(str(i), [3 + (7 * i + j) % (VOCAB - 3) for j in range(context)], params)

    def answer(token: int) -> None:
        plan = scheduler.schedule()
        seq_ids = tuple(s.seq_id for s in plan.seqs)
        scheduler.postprocess(plan, StepResult(plan.step_id, seq_ids, (token,) * len(seq_ids)))

    answer(5)  # the prompts' step
    times = []
    for step in range(steps):
        start = time.perf_counter()
        answer(5 + step % 100)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1000, 4000, 8000])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    step_times(args.streams, args.contexts[0], 20)  # warm-up: first calls, imports
    print(f"{args.streams} decoding sequences, {args.steps} steps: schedule + postprocess, us")
    print("| context | median | fastest tenth |")
    print("|---|---|---|")
    for context in args.contexts:
        times = sorted(step_times(args.streams, context, args.steps))
        print(f"| {context} | {statistics.median(times) * 1e6:.0f} | {times[len(times) // 10] * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
