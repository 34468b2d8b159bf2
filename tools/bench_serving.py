"""Serving benchmark: N concurrent streams through the Engine, on the CPU by default.

For each N in --streams, N greedy requests (distinct prompts of --prompt-tokens tokens, so the
prefix cache does not help; --new-tokens each, EOS ignored) start together. Reported per N:
aggregate decode tok/s (tokens after each stream's first, over the span from the first first
token to the last token), p50/p95 TTFT and TPOT (from each request's Usage), and the speedup
over one stream. Targets from issue 3: 16 streams >= 5x the throughput of 1 stream, and TPOT p95
at 16 streams <= 3x the single-stream TPOT.

    python tools/bench_serving.py --streams 1 4 16 64 --new-tokens 64 [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgeinfer.config import KV_DTYPES, LINEAR_PATHS, RuntimeConfig, SchedulerConfig  # noqa: E402
from edgeinfer.core.events import Error, Finished  # noqa: E402
from edgeinfer.core.request import GenerateRequest  # noqa: E402
from edgeinfer.core.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.engine.api import Engine, EngineConfig  # noqa: E402
from edgeinfer.models.pull import default_model_path  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


def prompt_ids(engine: Engine, stream: int, num_tokens: int) -> tuple[int, ...]:
    text = f"Story number {stream}. " + "Once upon a time, in a land far away, there lived a king. " * 64
    return tuple(engine.tokenizer.encode(text)[:num_tokens])


async def run_round(engine: Engine, num_streams: int, prompt_tokens: int, new_tokens: int,
                    round_id: str) -> dict[str, float]:
    finished: list[tuple[float, Finished]] = []  # (wall time of the last token, event)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()

    async def one(i: int) -> None:
        request = GenerateRequest(f"{round_id}-{i}", prompt_token_ids=prompt_ids(engine, i, prompt_tokens),
                                  params=params)
        async for event in engine.generate(request):
            if isinstance(event, Error):
                raise RuntimeError(f"request {request.request_id} failed: {event.code}: {event.message}")
            if isinstance(event, Finished):
                finished.append((time.perf_counter(), event))

    async with anyio.create_task_group() as tg:
        for i in range(num_streams):
            tg.start_soon(one, i)
    wall = time.perf_counter() - start
    usages = [event.usage for _, event in finished]
    first_token = min(u.ttft_s for u in usages)  # request times count from (nearly) `start`
    last_token = max(end - start for end, _ in finished)
    decode_tokens = sum(u.completion_tokens - 1 for u in usages)
    return {
        "streams": num_streams,
        "wall_s": wall,
        "tok_s": sum(u.completion_tokens for u in usages) / wall,
        "decode_tok_s": decode_tokens / max(last_token - first_token, 1e-9),
        "ttft_p50_s": percentile([u.ttft_s for u in usages], 50),
        "ttft_p95_s": percentile([u.ttft_s for u in usages], 95),
        "tpot_p50_s": percentile([u.tpot_s for u in usages], 50),
        "tpot_p95_s": percentile([u.tpot_s for u in usages], 95),
    }


async def bench(args: argparse.Namespace) -> list[dict[str, float]]:
    runtime = RuntimeConfig(device=args.device, linear_path=args.linear_path, kv_dtype=args.kv_dtype,
                            num_threads=args.threads, kv_memory_bytes=args.kv_memory_mib << 20)
    scheduler = SchedulerConfig(max_num_seqs=max(args.streams),
                                max_num_batched_tokens=max(args.token_budget, max(args.streams)),
                                max_waiting=max(args.streams))
    rows = []
    async with Engine(EngineConfig(str(args.model), runtime, scheduler)) as engine:
        await run_round(engine, 1, args.prompt_tokens, 4, "warmup")
        for n in args.streams:
            rows.append(await run_round(engine, n, args.prompt_tokens, args.new_tokens, f"n{n}"))
    base = next((r for r in rows if r["streams"] == 1), None)
    for row in rows:
        ok = base is not None and base["decode_tok_s"] > 0 and base["tpot_p50_s"] > 0
        row["speedup"] = row["decode_tok_s"] / base["decode_tok_s"] if ok else float("nan")
        row["tpot_p95_vs_1"] = row["tpot_p95_s"] / base["tpot_p50_s"] if ok else float("nan")
    return rows


def print_table(rows: list[dict[str, float]]) -> None:
    print(f"{'streams':>7} {'decode tok/s':>12} {'speedup':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'TPOT p50':>9} {'TPOT p95':>9} {'p95/1':>6}")
    for r in rows:
        ms = {k: r[k] * 1e3 for k in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s")}
        print(f"{r['streams']:>7} {r['decode_tok_s']:>12.1f} {r['speedup']:>7.2f}x "
              f"{ms['ttft_p50_s']:>7.0f}ms {ms['ttft_p95_s']:>7.0f}ms "
              f"{ms['tpot_p50_s']:>7.1f}ms {ms['tpot_p95_s']:>7.1f}ms {r['tpot_p95_vs_1']:>5.2f}x")
    at16 = next((r for r in rows if r["streams"] == 16), None)
    if at16 is not None:
        print(f"targets at 16 streams: throughput {at16['speedup']:.2f}x (>= 5x: "
              f"{'ok' if at16['speedup'] >= 5 else 'MISSED'}), TPOT p95 {at16['tpot_p95_vs_1']:.2f}x "
              f"single-stream (<= 3x: {'ok' if at16['tpot_p95_vs_1'] <= 3 else 'MISSED'})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=default_model_path(), type=Path)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=512, help="max tokens per step (prefill chunks)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--linear-path", default="auto", choices=LINEAR_PATHS)
    p.add_argument("--kv-dtype", default="auto", choices=("auto", *KV_DTYPES))
    p.add_argument("--kv-memory-mib", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = anyio.run(bench, args)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
