"""Where one decode step of the engine goes, at one stream or many, and why the compute thread matters.

1. `step`: the default model through `Engine` (--streams requests of --prompt-tokens tokens,
   256 by default, --new-tokens tokens, greedy or --temperature / --top-p, --runs runs), the steps
   where every stream decodes one token:
   median time from a step's start to the next one's, of which the model forward
   (ModelRunner.logits), the rest of the model actor's step (batch, sampling, result), and the
   scheduler's schedule + postprocess; what is left is the event loop (mailboxes, event
   streams, waking on the compute thread). The target (issues #20 and #24, at 1
   and 16 streams): under 10% of the step outside the forward.
2. `forward`: the fused step alone (LlamaModel.forward, no engine): --streams rows decoding one
   token each after --context cached tokens (fp16 KV; each step adds one, so the last of
   --repeats steps runs after --context + --repeats), --repeats steps; the fastest tenth and
   the median, ms. Fewer moving parts than `step` for an A/B of the kernels on a noisy host
   (run it from a worktree of each commit, alternated). Where the linears run the int8-activation
   kernels, also the step's a8 work as a fraction of this machine's peaks: their dot products
   (every term counted) against tools/int8_peak.py's rate for the instruction set that runs
   them, and their weights' bytes (read once a step) as GB/s against torch's sum over 1 GB
   (tools/bench_weight_stream.py's reference read), both at the fastest tenth. With --phases,
   where the fused step's time goes (the op's own clocks, kernels.cpu_ops.DECODE_PHASES: its
   layers' norms, each GEMM, RoPE and the K/V writes, attention, the activation), summed over the
   layers, per step (the mean over the timed steps), and each GEMM's weight read rate; then the
   rest of the decode_layers call (its arguments, checks and parallel region), the head (from the
   final norm's output to the logits: the coarse GEMM, its top rows, their rows read and their
   exact refinement, each also alone) and the rest of the forward (the embedding, the final norm
   and its rows, the step's own arguments).
3. `threads`: one int4 GEMM (1 x 576 x 1536, the C++ CPU op) built and run on one thread while
   the main thread has run no OpenMP region (the engine's compute thread), on the main thread,
   and built on the main thread but run on a second one: the effect
   `engine.model_actor.compute_thread` exists for (two OpenMP pools on a 2-core machine).

Wraps the engine's internals with timers (private attributes): a measurement tool, not an API.

    python tools/bench_engine_step.py [step|forward|threads|all] [--runs 5] [--new-tokens 128] [--per-op]
                                      [--streams 16] [--prompt-tokens 256] [--context 300] [--repeats 100]
                                      [--temperature 0.8 --top-p 0.95]
                                      [--cpu-activations auto|int16|int8|int8x2|int8x2-lean|bf16]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from edgeinfer.cli.event_loop import run_coroutine  # noqa: E402
from edgeinfer.config import CPU_ACTIVATIONS, RuntimeConfig, SchedulerConfig  # noqa: E402
from edgeinfer.core.request import GenerateRequest  # noqa: E402
from edgeinfer.core.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.engine.api import Engine, EngineConfig  # noqa: E402
from edgeinfer.models.pull import default_model_path  # noqa: E402
from kernels import cpu_a8, cpu_ops  # noqa: E402


def timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out
    return wrapper


async def step_breakdown(runs: int, new_tokens: int, per_op: bool = False, streams: int = 1,
                         cpu_activations: str = RuntimeConfig.cpu_activations, prompt_tokens: int = 256,
                         temperature: float = 0.0, top_p: float = 1.0) -> None:
    runtime = RuntimeConfig(num_kv_blocks=64 * streams, cpu_activations=cpu_activations)
    config = EngineConfig(str(default_model_path()), runtime, SchedulerConfig())
    async with Engine(config) as engine:
        if per_op:  # what steps the fused C++ step does not take run (over 128 tokens, observers)
            model = engine._runner.model
            model.backend = dataclasses.replace(model.backend, fused_step_max_tokens=0)
        forward: list[float] = []
        steps: list[tuple[float, float, bool]] = []  # (start, end, every stream decoding one token)
        plan: list[float] = []
        engine._runner.logits = timed(forward, engine._runner.logits)
        execute = engine._model_actor.execute

        def stamped(step_plan: Any) -> Any:
            start = time.perf_counter()
            out = execute(step_plan)
            full = len(step_plan.seqs) == streams and all(len(s.token_ids) == 1 for s in step_plan.seqs)
            steps.append((start, time.perf_counter(), full))
            return out

        engine._model_actor.execute = stamped
        scheduler = engine._scheduler_actor.scheduler
        scheduler.schedule = timed(plan, scheduler.schedule)
        scheduler.postprocess = timed(plan, scheduler.postprocess)
        text = "Once upon a time, in a land far away, there lived a king. " * 40
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=new_tokens, ignore_eos=True)
        print(f"{streams} stream(s) of {prompt_tokens}-token prompts, cpu activations {cpu_activations}"
              f"{', per-op forward' if per_op else ''}, "
              + ("greedy" if not temperature else f"temperature {temperature}, top_p {top_p}"))
        print("run  decode steps  step ms  forward ms  actor rest ms  schedule+post ms  outside the forward")
        for run in range(runs):
            for record in (forward, steps, plan):
                record.clear()

            async def one(i: int, run: int = run) -> None:
                # Each stream its own prompt (a distinct first word), so no prefix is shared.
                prompt = tuple(engine.tokenizer.encode(f"{i} {run} {text}"))[:prompt_tokens]
                request = GenerateRequest(f"r{run}-{i}", prompt_token_ids=prompt, params=params)
                async for _ in engine.generate(request):
                    pass

            await asyncio.gather(*(one(i) for i in range(streams)))
            # Steps where every stream decodes one token (no prompt chunk, none finished), each
            # from its start to the next step's start: what a token costs each stream then.
            full = [i for i, (_, _, f) in enumerate(steps[:-1]) if f]
            step = statistics.median(steps[i + 1][0] - steps[i][0] for i in full)
            fwd = statistics.median(forward[i] for i in full)
            rest = statistics.median(steps[i][1] - steps[i][0] - forward[i] for i in full)
            sched = 2 * statistics.median(plan)
            print(f"{run:3d}  {len(full):12d}  {step * 1e3:7.2f}  {fwd * 1e3:10.2f}  {rest * 1e3:13.3f}"
                  f"  {sched * 1e3:16.3f}  {(step - fwd) * 1e3:.2f} ms = {(step - fwd) / step:.1%}")


def forward_only(rows: int, context: int, repeats: int,
                 cpu_activations: str = RuntimeConfig.cpu_activations, phases: bool = False,
                 threads: int | None = None) -> None:
    from bench_arch_step import decode_times
    from bench_common import fastest_tenth

    from edgeinfer.models import llama
    from edgeinfer.models.loader import load_model
    from edgeinfer.worker.build import build_model

    model = build_model(load_model(str(default_model_path())),
                        RuntimeConfig(cpu_activations=cpu_activations, num_threads=threads))
    phase_ns = torch.zeros(len(cpu_ops.DECODE_PHASES), dtype=torch.int64) if phases else None
    calls: list[float] = []  # the decode_layers calls, then the heads; the timed steps' are the last
    heads: list[float] = []
    head_parts: dict[str, list[float]] = {"coarse GEMM": [], "top rows": [], "row reads": [], "refinement": []}
    if phases:
        in_head = [False]  # the parts below are counted only inside the head (not the embedding's rows)

        def head(*args: Any) -> Any:
            in_head[0] = True
            try:
                return head_call(*args)
            finally:
                in_head[0] = False

        def part(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
            inner = timed(record, fn)
            return lambda *args, **kwargs: inner(*args, **kwargs) if in_head[0] else fn(*args, **kwargs)

        head_call = timed(heads, model._head)
        model._head = head
        cpu_ops.decode_layers = timed(calls, cpu_ops.decode_layers)
        # As llama.LlamaModel._head calls them.
        llama.linear = part(head_parts["coarse GEMM"], llama.linear)
        cpu_ops.row_topk = part(head_parts["top rows"], cpu_ops.row_topk)
        llama.weight_rows = part(head_parts["row reads"], llama.weight_rows)
        cpu_ops.refine_logits = part(head_parts["refinement"], cpu_ops.refine_logits)
    with torch.inference_mode():
        times = decode_times(model, model.config, rows, context, repeats, phase_ns)
    fast = fastest_tenth(times)
    print(f"forward, {rows} row(s) after {context} tokens, cpu activations {cpu_activations}, "
          f"{torch.get_num_threads()} thread(s), {repeats} steps: "
          f"fastest tenth {fast * 1e3:.2f} ms, median {statistics.median(times) * 1e3:.2f} ms")
    if phase_ns is not None:
        print_phases(model, phase_ns / repeats / 1e3, statistics.mean(times) * 1e6,
                     statistics.mean(calls[-repeats:]) * 1e6, statistics.mean(heads[-repeats:]) * 1e6)
        for name, record in head_parts.items():
            if record:  # the last `repeats` calls are the timed steps' heads'
                print(f"    {'head: ' + name:>22} {statistics.mean(record[-repeats:]) * 1e6:8.0f} us")
    a8 = [w.kernel for w in (*model.weights.linears(), model.weights.head) if isinstance(w.kernel, cpu_a8.A8Weight)]
    if a8 and not any(w.bf16 for w in a8):
        from bench_weight_stream import sum_rates
        from int8_peak import peak_gops

        ops = sum(2 * rows * w.shape[0] * w.shape[1] * w.terms for w in a8)
        isa = cpu_a8.run_isa(cpu_a8.default_isa(), rows, max(w.terms for w in a8))
        peak = peak_gops(isa, torch.get_num_threads())
        nbytes = sum(w.nbytes for w in a8)
        print(f"  a8 GEMMs: {ops / 1e9:.2f} GOP a step (terms counted) = {ops / fast / 1e9:.0f} GOP/s, "
              f"{ops / fast / 1e9 / peak:.0%} of {isa}'s {peak:.0f}; weights {nbytes / 1e6:.1f} MB a step = "
              f"{nbytes / fast / 1e9:.1f} GB/s, {nbytes / fast / 1e9 / max(sum_rates(3)):.0%} of torch's sum")


def print_phases(model: Any, us: torch.Tensor, step_us: float, call_us: float, head_us: float) -> None:
    """The fused step's phases (``us``: microseconds a step, cpu_ops.DECODE_PHASES' order) beside
    the mean step, each GEMM with its layers' weight bytes as a read rate; then the rest of the
    decode_layers call (``call_us`` a step: its arguments, checks and parallel region) and the head
    (``head_us``: the final norm's output to logits, the refinement included)."""
    layers = model.weights.layers
    gemm_bytes = {"qkv": sum(_nbytes(layer.qkv) + _nbytes(layer.v) for layer in layers),
                  "o": sum(_nbytes(layer.o) for layer in layers),
                  "gate/up": sum(_nbytes(layer.gate_up) for layer in layers),
                  "down + residual": sum(_nbytes(layer.down) for layer in layers)}
    print(f"  fused step phases, us a step (mean step {step_us:.0f} us):")
    for name, value in zip(cpu_ops.DECODE_PHASES, us.tolist(), strict=True):
        rate = f"  {gemm_bytes[name] / value / 1e3:5.1f} GB/s of weights" if name in gemm_bytes and value else ""
        print(f"    {name:>16} {value:8.0f} us {value / step_us:5.1%}{rate}")
    layers_us = us.sum().item()
    print(f"    {'all layers':>16} {layers_us:8.0f} us {layers_us / step_us:5.1%}")
    for name, value in (("rest of the call", call_us - layers_us), ("head", head_us),
                        ("rest of forward", step_us - call_us - head_us)):
        print(f"    {name:>16} {value:8.0f} us {value / step_us:5.1%}")


def _nbytes(linear: Any) -> int:
    """A prepared linear's kernel bytes (0 for none, or a kernel that does not count them)."""
    return getattr(linear.kernel, "nbytes", 0) if linear is not None else 0


def gemm_on_threads() -> None:
    from quant.formats import quantize_int4

    if not cpu_ops.available():
        print("threads: the C++ CPU ops are not available here")
        return

    def build() -> tuple[Any, torch.Tensor]:
        return cpu_ops.prepare_int4(quantize_int4(torch.randn(1536, 576), 32)), torch.randn(1, 576)

    def median_us(weight: Any, x: torch.Tensor) -> float:
        with torch.inference_mode():
            cpu_ops.int4_linear(x, weight)
            times = []
            for _ in range(300):
                start = time.perf_counter()
                cpu_ops.int4_linear(x, weight)
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    # Order matters: an OpenMP pool lives as long as its thread, so the single-thread case runs
    # first, before the main thread has entered any parallel region.
    with ThreadPoolExecutor(1) as alone:
        one = alone.submit(lambda: median_us(*build())).result()
    print(f"int4 GEMM 1x576x1536, built and run on one other thread, main idle (the engine now): {one:.1f} us")
    weight, x = build()
    print(f"  built and run on the main thread: {median_us(weight, x):.1f} us")
    with ThreadPoolExecutor(1) as other:
        two = other.submit(median_us, weight, x).result()
    print(f"  built on the main thread, run on a second one (the engine before): {two:.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=("step", "forward", "threads", "all"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--per-op", action="store_true",
                        help="step: the per-op forward instead of the fused C++ step (its cost)")
    parser.add_argument("--streams", type=int, default=1,
                        help="step: concurrent requests; forward: rows (default: 1)")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="step: each request's prompt (at most 600)")
    parser.add_argument("--cpu-activations", choices=CPU_ACTIVATIONS, default=RuntimeConfig.cpu_activations)
    parser.add_argument("--temperature", type=float, default=0.0, help="step: 0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="step: with --temperature (default: 1, off)")
    parser.add_argument("--context", type=int, default=300, help="forward: cached tokens per row (default: 300)")
    parser.add_argument("--repeats", type=int, default=100, help="forward: steps timed (default: 100)")
    parser.add_argument("--phases", action="store_true", help="forward: the fused step's phases (see above)")
    parser.add_argument("--threads", type=int, default=None, help="forward: compute threads (default: one per core)")
    args = parser.parse_args()
    if (args.phases or args.threads is not None) and args.what != "forward":
        parser.error("--phases and --threads go with forward")
    if args.what in ("threads", "all"):
        gemm_on_threads()
    if args.what == "forward":
        forward_only(args.streams, args.context, args.repeats, args.cpu_activations, args.phases, args.threads)
    if args.what in ("step", "all"):
        run_coroutine(step_breakdown(args.runs, args.new_tokens, args.per_op, args.streams, args.cpu_activations,
                                 args.prompt_tokens, args.temperature, args.top_p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
