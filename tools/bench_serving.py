"""Serving benchmark: N concurrent streams, through the engine, its OpenAI HTTP API, and llama.cpp.

For each N in --streams, N greedy requests, or sampled ones with --temperature and --top-p
(distinct prompts of --prompt-tokens token ids, so the prefix cache does not help; --new-tokens
each, EOS ignored) start together. Targets (--target):

- ``engine``: edgeinfer's Engine in this process, on the event loop the commands run
  (edgeinfer.cli.event_loop: uvloop where installed; times taken where its events arrive, from the
  round's start, as the HTTP client takes them).
- ``openai``: ``edgeinfer serve`` in a subprocess, driven over ``POST /v1/completions`` with
  ``stream: true`` by tools/bench_http.py's client (times taken at the client).
- ``llama-server``: llama.cpp's server (``$LLAMA_CPP_BIN``, see tools/build_llama_cpp.sh) with
  ``--parallel`` = the largest N, the same GGUF and threads, driven by the same client.
- ``llama-batched-bench``: llama.cpp's ``llama-batched-bench -npp P -ntg T -npl N`` (its own
  timing: prefill of all N prompts, then N streams decoding in lockstep).

Every target's requests (their prompts tokenized, the HTTP ones as bytes on open connections) are
ready before its round's clock starts. Reported per target and N: aggregate decode tok/s (tokens
after each stream's first, over the span from the first first token to the last token), steady
decode tok/s (the tokens after the last stream's first token, over the span from it to the last
token: every stream decoding, no prompt in the step; llama-batched-bench's S_TG is this figure,
while the first one holds, for the engine, the steps that ran other streams' prompts beside the
first streams' tokens), p50/p95 TTFT and TPOT, and the speedup over one stream. With --runs R
the targets alternate R times (this machine is shared: the spread matters); the summary gives
median (min-max) per figure and
ratios of each target to the first. --paired (engine and openai only) keeps both up and runs
their rounds back to back, so each ratio compares rounds seconds apart (see run_paired).

    eval "$(tools/build_llama_cpp.sh)"   # for the llama.cpp targets
    python tools/bench_serving.py --target engine openai llama-server --streams 1 4 16 --runs 3
    python tools/bench_serving.py --target engine openai --paired --streams 1 16 --runs 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import free_port, wait_healthy  # noqa: E402
from bench_http import Connection  # noqa: E402

from edgeinfer.cli.event_loop import run_async  # noqa: E402
from edgeinfer.config import CPU_ACTIVATIONS, KV_DTYPES, LINEAR_PATHS, RuntimeConfig, SchedulerConfig  # noqa: E402
from edgeinfer.core.events import Error, Finished, Token  # noqa: E402
from edgeinfer.core.request import GenerateRequest  # noqa: E402
from edgeinfer.core.sampling_params import SamplingParams  # noqa: E402
from edgeinfer.engine.api import Engine, EngineConfig  # noqa: E402
from edgeinfer.models.loader import load_model  # noqa: E402
from edgeinfer.models.pull import default_model_path  # noqa: E402

TARGETS = ("engine", "openai", "llama-server", "llama-batched-bench")
PAIRED_PAUSE_S = 0.6  # between --paired rounds
FIGURES = ("decode_tok_s", "steady_tok_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


def prompt_ids(encode, key: str, num_tokens: int) -> list[int]:  # noqa: ANN001
    """A prompt that no earlier one shares a prefix block with (``key`` differs per round and
    stream), so neither edgeinfer's prefix cache nor llama-server's prompt cache helps."""
    text = f"Story {key}. " + "Once upon a time, in a land far away, there lived a king. " * 64
    return list(encode(text)[:num_tokens])


def round_figures(num_streams: int, streams: list[tuple[list[float], float, int]],
                  wall_s: float) -> dict[str, float]:
    """``streams``: per request (each token's arrival, the first's being the TTFT; the end; the
    tokens), times in s from the round's start."""
    ttfts = [times[0] for times, _, _ in streams]
    last_first = max(ttfts)
    last_token = max(end for _, end, _ in streams)
    tpots = [(end - times[0]) / (n - 1) for times, end, n in streams if n > 1]
    steady = sum(1 for times, _, _ in streams for t in times if t > last_first)
    return {"streams": num_streams, "wall_s": wall_s,
            "decode_tok_s": sum(n - 1 for _, _, n in streams) / max(last_token - min(ttfts), 1e-9),
            "steady_tok_s": steady / (last_token - last_first) if last_token > last_first else 0.0,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p95_s": percentile(tpots, 95)}


# --- engine, in process -------------------------------------------------------------------------

async def engine_round(engine: Engine, num_streams: int, args: argparse.Namespace, round_id: str,
                       new_tokens: int | None = None) -> dict[str, float]:
    done: list[tuple[list[float], float, int]] = []
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=new_tokens or args.new_tokens,
                            ignore_eos=True)
    requests = [GenerateRequest(f"{round_id}-{i}", params=params, prompt_token_ids=tuple(
        prompt_ids(engine.tokenizer.encode, f"{round_id}-{i}", args.prompt_tokens))) for i in range(num_streams)]
    start = time.perf_counter()

    async def one(i: int) -> None:
        request = requests[i]
        times: list[float] = []
        async for event in engine.generate(request):
            if isinstance(event, Error):
                raise RuntimeError(f"request {request.request_id} failed: {event.code}: {event.message}")
            if isinstance(event, Token):
                times.extend([time.perf_counter() - start] * len(event.token_ids))
            if isinstance(event, Finished):
                assert times, f"request {request.request_id} had no token"
                done.append((times, time.perf_counter() - start, event.usage.completion_tokens))

    async with anyio.create_task_group() as tg:
        for i in range(num_streams):
            tg.start_soon(one, i)
    return round_figures(num_streams, done, time.perf_counter() - start)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    runtime = RuntimeConfig(device=args.device, linear_path=args.linear_path, kv_dtype=args.kv_dtype,
                            cpu_activations=args.cpu_activations, num_threads=args.threads,
                            kv_memory_bytes=args.kv_memory_mib << 20, share_cpu=not args.fixed_threads,
                            compute_nice=args.compute_nice)
    scheduler = SchedulerConfig(max_num_seqs=max(args.streams),
                                max_num_batched_tokens=None if args.token_budget is None
                                else max(args.token_budget, max(args.streams)),
                                max_waiting=max(args.streams))
    return EngineConfig(str(args.model), runtime, scheduler)


async def run_engine(args: argparse.Namespace, tag: str) -> list[dict[str, float]]:
    async with Engine(engine_config(args)) as engine:
        await engine_round(engine, 1, args, f"{tag}-warmup", new_tokens=4)
        return [await engine_round(engine, n, args, f"{tag}-n{n}") for n in args.streams]


# --- HTTP servers: edgeinfer serve and llama-server, one client -----------------------------------

async def http_round(port: int, headers: dict[str, str], num_streams: int, args: argparse.Namespace,
                     encode, round_id: str, new_tokens: int | None = None) -> dict[str, float]:  # noqa: ANN001
    """One round through the HTTP API. Before the clock starts, as the engine target's requests are
    built before its clock: every stream's connection is open (as a client's pool keeps them;
    opened inside the round, the connections after the first reached the server while the first
    prompt ran alone, ~70 ms more TTFT at 16 streams), and every request's bytes are built (the
    prompt's tokenization alone cost ~3 ms a stream, spacing the sends)."""
    connections = [Connection("127.0.0.1", port, headers) for _ in range(num_streams)]
    try:
        return await _timed_round(connections, args, encode, round_id, new_tokens)
    finally:
        for connection in connections:
            await connection.close()


async def _timed_round(connections: list[Connection], args: argparse.Namespace, encode,  # noqa: ANN001
                       round_id: str, new_tokens: int | None) -> dict[str, float]:
    done: list[tuple[list[float], float, int]] = []
    num_streams = len(connections)
    for connection in connections:
        await connection.open()
    model = (await connections[0].get_json("/v1/models"))["data"][0]["id"]
    requests = [connection.request_bytes("POST", "/v1/completions", {
        "model": model, "prompt": prompt_ids(encode, f"{round_id}-{i}", args.prompt_tokens),
        "max_tokens": new_tokens or args.new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "stream": True, "ignore_eos": True,
        "cache_prompt": False, "stream_options": {"include_usage": True}})
        for i, connection in enumerate(connections)]
    start = time.perf_counter()

    async def one(i: int) -> None:
        usage, times = None, []
        async for data in connections[i].events():
            # JSON is parsed only where needed: on 2 cores the client's own work slows the server.
            if not data.startswith(b"{"):
                continue
            if not times or b'"usage": {' in data or b'"usage":{' in data:
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                if not (chunk.get("choices") and chunk["choices"][0].get("text")):
                    continue
            times.append(time.perf_counter() - start)
        assert times, f"stream {i} had no token"
        tokens = usage or len(times)
        # The last chunk (finish_reason, text "") is timed among them: the usage says how many carried tokens.
        done.append((times[:tokens], time.perf_counter() - start, tokens))

    for connection, request in zip(connections, requests, strict=True):
        connection.write(request)
    async with anyio.create_task_group() as tg:
        for i in range(num_streams):
            tg.start_soon(one, i)
    return round_figures(num_streams, done, time.perf_counter() - start)


def run_http(target: str, args: argparse.Namespace, encode, tag: str) -> list[dict[str, float]]:  # noqa: ANN001
    with served(target, args) as (port, headers):
        async def rounds() -> list[dict[str, float]]:
            await http_round(port, headers, 1, args, encode, f"{tag}-warmup", new_tokens=4)
            return [await http_round(port, headers, n, args, encode, f"{tag}-n{n}") for n in args.streams]

        return run_async(rounds)


def run_alternated(args: argparse.Namespace, encode) -> dict[str, list[list[dict[str, float]]]]:  # noqa: ANN001
    """--runs runs, each of every target in turn (a process or a server each)."""
    results: dict[str, list[list[dict[str, float]]]] = {t: [] for t in args.target}
    for run in range(args.runs):
        for target in args.target:
            if target == "engine":
                results[target].append(run_async(run_engine, args, f"r{run}"))
            elif target == "llama-batched-bench":
                results[target].append(run_batched_bench(args))
            else:
                results[target].append(run_http(target, args, encode, f"r{run}"))
    return results


def run_paired(args: argparse.Namespace, encode) -> dict[str, list[list[dict[str, float]]]]:  # noqa: ANN001
    """--paired: the engine in this process and `edgeinfer serve` both up for the whole
    invocation, their rounds back to back for each stream count (which goes first alternates per
    run), so that each engine / openai ratio compares two rounds seconds apart rather than two
    processes' lifetimes: on this shared machine the speed drifts by +-20% over minutes. Each
    round starts PAIRED_PAUSE_S after the last, once the other target's threads are quiet. (Their
    rounds fall in each other's idle time, which RuntimeConfig.share_cpu no longer judges:
    edgeinfer.worker.cpu_share.STALE_S.)"""
    results: dict[str, list[list[dict[str, float]]]] = {"engine": [], "openai": []}

    async def rounds(engine: Engine, port: int, headers: dict[str, str]) -> None:
        await engine_round(engine, 1, args, "warmup", new_tokens=4)
        await http_round(port, headers, 1, args, encode, "warmup", new_tokens=4)
        for run in range(args.runs):
            for rows in results.values():
                rows.append([])
            for n in args.streams:
                for target in ("engine", "openai") if run % 2 == 0 else ("openai", "engine"):
                    await anyio.sleep(PAIRED_PAUSE_S)
                    tag = f"r{run}-n{n}-{target}"
                    row = await (engine_round(engine, n, args, tag) if target == "engine"
                                 else http_round(port, headers, n, args, encode, tag))
                    results[target][run].append(row)

    async def main() -> None:
        with served("openai", args) as (port, headers):
            async with Engine(engine_config(args)) as engine:
                await rounds(engine, port, headers)

    run_async(main)
    return results


@contextlib.contextmanager
def served(target: str, args: argparse.Namespace) -> Iterator[tuple[int, dict[str, str]]]:
    """The target's server in a subprocess, up and healthy: (port, request headers)."""
    port, ctx, parallel = free_port(), args.prompt_tokens + args.new_tokens + 16, max(args.streams)
    threads = str(args.threads or os.cpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        log, headers = Path(tmp) / "server.log", {}
        if target == "openai":
            cmd = [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", str(args.model), "--port", str(port),
                   "--ctx", str(ctx), "--parallel", str(parallel), "--threads", threads,
                   "--linear-path", args.linear_path, "--kv-dtype", args.kv_dtype,
                   "--cpu-activations", args.cpu_activations, "--compute-nice", str(args.compute_nice)]
            env, health = {**os.environ, "EDGEINFER_CONFIG_DIR": tmp}, "/healthz"
        else:
            cmd = [str(Path(os.environ["LLAMA_CPP_BIN"]) / "llama-server"), "-m", str(args.model), "--port", str(port),
                   "-c", str(ctx * parallel), "--parallel", str(parallel), "-t", threads, "--no-webui"]
            env, health = dict(os.environ), "/health"
        with open(log, "w") as out:
            process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}{health}", process, log=log)
            if target == "openai":
                headers = {"Authorization": f"Bearer {(Path(tmp) / 'token').read_text().strip()}"}
            yield port, headers
        finally:
            process.terminate()
            process.wait(timeout=60)


# --- llama-batched-bench --------------------------------------------------------------------------

def run_batched_bench(args: argparse.Namespace) -> list[dict[str, float]]:
    """One row per N from llama-batched-bench's table: decode tok/s is its S_TG (all streams), TPOT
    its T_TG / tokens per stream, TTFT the prefill time of all N prompts (T_PP)."""
    cmd = [str(Path(os.environ["LLAMA_CPP_BIN"]) / "llama-batched-bench"), "-m", str(args.model),
           "-c", str((args.prompt_tokens + args.new_tokens) * max(args.streams)), "-b", "2048", "-ub", "512",
           "-npp", str(args.prompt_tokens), "-ntg", str(args.new_tokens),
           "-npl", ",".join(map(str, args.streams)), "-t", str(args.threads or os.cpu_count())]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():  # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0]) and re.fullmatch(r"\d+", cells[2]):
            n, t_pp, t_tg, s_tg = int(cells[2]), float(cells[4]), float(cells[6]), float(cells[7])
            tpot = t_tg / args.new_tokens
            rows.append({"streams": n, "wall_s": t_pp + t_tg, "decode_tok_s": s_tg, "steady_tok_s": s_tg,
                         "ttft_p50_s": t_pp,
                         "ttft_p95_s": t_pp, "tpot_p50_s": tpot, "tpot_p95_s": tpot})
    if len(rows) != len(args.streams):
        raise RuntimeError(f"could not read llama-batched-bench's table:\n{out}")
    return rows


# --- report ---------------------------------------------------------------------------------------

def spread(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def print_summary(results: dict[str, list[list[dict[str, float]]]], streams: list[int]) -> None:
    """results[target][run][i] is the row for streams[i]."""
    print("| target | streams | decode tok/s | vs 1 stream | steady decode tok/s | vs 1 stream | TTFT p50 ms | "
          "TPOT p50 ms | TPOT p95 ms | TPOT p95 / 1-stream p50 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for target, runs in results.items():
        for i, n in enumerate(streams):
            rows = [run[i] for run in runs]
            base = [run[streams.index(1)] for run in runs] if 1 in streams else None
            pairs = list(zip(rows, base, strict=True)) if base else []
            speedup = spread([r["decode_tok_s"] / b["decode_tok_s"] for r, b in pairs], fmt=".2f") if base else "-"
            steady = spread([r["steady_tok_s"] / b["steady_tok_s"] for r, b in pairs], fmt=".2f") if base else "-"
            tail = spread([r["tpot_p95_s"] / b["tpot_p50_s"] for r, b in pairs], fmt=".2f") if base else "-"
            print(f"| {target} | {n} | {spread([r['decode_tok_s'] for r in rows])} | {speedup} | "
                  f"{spread([r['steady_tok_s'] for r in rows])} | {steady} | "
                  f"{spread([r['ttft_p50_s'] for r in rows], 1e3, '.0f')} | "
                  f"{spread([r['tpot_p50_s'] for r in rows], 1e3)} | {spread([r['tpot_p95_s'] for r in rows], 1e3)} | "
                  f"{tail} |")
    names = list(results)
    for other in names[1:]:
        print(f"\n{names[0]} / {other}, per run (median (min-max)):")
        for i, n in enumerate(streams):
            pairs = list(zip(results[names[0]], results[other], strict=True))
            tok = spread([a[i]["decode_tok_s"] / b[i]["decode_tok_s"] for a, b in pairs], fmt=".2f")
            steady = spread([a[i]["steady_tok_s"] / b[i]["steady_tok_s"] for a, b in pairs], fmt=".2f")
            ttft = spread([a[i]["ttft_p50_s"] / b[i]["ttft_p50_s"] for a, b in pairs], fmt=".2f")
            print(f"  {n:>3} streams: decode tok/s {tok}x, steady decode {steady}x, TTFT p50 {ttft}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", nargs="+", default=["engine"], choices=TARGETS,
                   help="what to drive, alternated per run; ratios are to the first (default: engine)")
    p.add_argument("--runs", type=int, default=1, help="alternated runs of all targets (default: 1)")
    p.add_argument("--model", default=default_model_path(), type=Path, help="GGUF file (default: the default model)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64], help="concurrent streams per round")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default: 64)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per stream (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="engine and HTTP targets: 0 is greedy (default); llama-batched-bench decodes greedily")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default: 1, off)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="engine: max tokens per step (default: the engine's for the device, 128 on the CPU)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="engine device (default: cpu)")
    p.add_argument("--linear-path", default="auto", choices=LINEAR_PATHS, help="edgeinfer linear path")
    p.add_argument("--cpu-activations", default=RuntimeConfig.cpu_activations, choices=CPU_ACTIVATIONS,
                   help="edgeinfer: activations of the CPU int4/int8 GEMMs (default: %(default)s)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", *KV_DTYPES), help="edgeinfer KV format")
    p.add_argument("--kv-memory-mib", type=int, default=1024, help="engine: KV pool MiB (default: 1024)")
    p.add_argument("--threads", type=int, default=None, help="threads of every target (default: one per core)")
    p.add_argument("--fixed-threads", action="store_true",
                   help="engine: keep the threads while other programs keep cores busy (RuntimeConfig.share_cpu)")
    p.add_argument("--compute-nice", type=int, default=RuntimeConfig.compute_nice,
                   help="edgeinfer: niceness added to the compute threads (default: %(default)s)")
    p.add_argument("--paired", action="store_true",
                   help="engine and openai both up, their rounds back to back per stream count (see run_paired)")
    p.add_argument("--json", action="store_true", help="print every run's rows as JSON too")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if any(t.startswith("llama") for t in args.target) and "LLAMA_CPP_BIN" not in os.environ:
        p.error("LLAMA_CPP_BIN is not set: run `eval \"$(tools/build_llama_cpp.sh)\"` first")
    if args.temperature and "llama-batched-bench" in args.target:
        p.error("llama-batched-bench decodes greedily: leave it out with --temperature (llama-server samples)")
    if args.paired and args.target != ["engine", "openai"]:
        p.error("--paired compares --target engine openai (in that order)")
    encode = load_model(str(args.model)).tokenizer.encode
    results = run_paired(args, encode) if args.paired else run_alternated(args, encode)
    if args.json:
        for target, runs in results.items():
            for run, rows in enumerate(runs):
                print(json.dumps({"target": target, "run": run, "rows": rows}))
    sampling = "greedy" if not args.temperature else f"sampled (temperature {args.temperature}, top_p {args.top_p})"
    print(f"{args.model.name}: {args.prompt_tokens}-token prompts, {args.new_tokens} {sampling} tokens per stream, "
          f"threads {args.threads or os.cpu_count()}, {args.runs} {'paired' if args.paired else 'alternated'} "
          "run(s), median (min-max)")
    print_summary(results, args.streams)


if __name__ == "__main__":
    main()
