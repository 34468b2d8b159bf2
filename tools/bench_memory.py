"""Resident memory of `edgeinfer serve` against llama.cpp's `llama-server`, same GGUF, same plan.

Both servers get the same plan: --ctx tokens for each of --parallel sequences (llama-server:
`-c ctx*parallel --parallel N`, its context is shared by its slots). Per run and server:
idle RSS once it answers its health check, and peak RSS while --streams greedy requests of
--prompt-tokens + --new-tokens run at once (RSS polled every 50 ms). edgeinfer's plan line
("memory plan: weights .. MB, KV cache .. MB") is read from its log; "plan" below is idle RSS
plus the KV cache the plan allows, the most a loaded server should reach. Runs alternate the two
servers, --runs times each (this machine is shared: give the spread).

    eval "$(tools/build_llama_cpp.sh)"      # llama-server
    python tools/bench_memory.py [--model GGUF] [--ctx 8192] [--parallel 4] [--streams 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import free_port, wait_healthy  # noqa: E402

from edgeinfer.models.pull import default_model_path  # noqa: E402

PROMPT = "Once upon a time, in a land far away, there lived a king who had three daughters. " * 40


class PeakRSS:
    """Polls a process's RSS on a thread while the block runs."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.05)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def load_edgeinfer(port: int, token: str, streams: int, prompt_tokens: int, new_tokens: int) -> None:
    from transport.client import connect

    async def one(client, i: int) -> None:  # noqa: ANN001
        async for event in client.generate(f"{i} {PROMPT}"[: prompt_tokens * 4], max_tokens=new_tokens,
                                           temperature=0.0, ignore_eos=True):
            if event["type"] == "error":
                raise RuntimeError(f"edgeinfer request {i}: {event}")

    async def main() -> None:
        async with connect(f"ws://127.0.0.1:{port}/ws", token) as client:
            await asyncio.gather(*(one(client, i) for i in range(streams)))

    asyncio.run(main())


def load_llama_server(port: int, streams: int, prompt_tokens: int, new_tokens: int) -> None:
    def one(i: int) -> None:
        body = json.dumps({"prompt": f"{i} {PROMPT}"[: prompt_tokens * 4], "n_predict": new_tokens,
                           "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_edgeinfer(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as config_dir:
        env = {**os.environ, "EDGEINFER_CONFIG_DIR": config_dir}
        log = Path(config_dir) / "serve.log"
        cmd = [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", str(args.model), "--port", str(port),
               "--ctx", str(args.ctx), "--parallel", str(args.parallel), "--threads", str(args.threads), "-v"]
        with open(log, "w") as out:
            process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/healthz", process)
            time.sleep(1)
            idle = psutil.Process(process.pid).memory_info().rss
            token = (Path(config_dir) / "token").read_text().strip()
            with PeakRSS(process.pid) as peak:
                load_edgeinfer(port, token, args.streams, args.prompt_tokens, args.new_tokens)
            plan = re.search(r"memory plan: weights ([0-9,]+) MB, KV cache \S+ ([0-9,]+) MB", log.read_text())
            kv = int(plan.group(2).replace(",", "")) * 10**6 if plan else 0
            return {"idle_mb": idle / 1e6, "loaded_mb": peak.peak / 1e6, "plan_mb": (idle + kv) / 1e6}
        finally:
            process.terminate()
            process.wait(timeout=60)


def run_llama_server(args: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    binary = Path(os.environ["LLAMA_CPP_BIN"]) / "llama-server"
    cmd = [str(binary), "-m", str(args.model), "--port", str(port), "-c", str(args.ctx * args.parallel),
           "--parallel", str(args.parallel), "-t", str(args.threads), "--no-webui"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", process)
        time.sleep(1)
        idle = psutil.Process(process.pid).memory_info().rss
        with PeakRSS(process.pid) as peak:
            load_llama_server(port, args.streams, args.prompt_tokens, args.new_tokens)
        return {"idle_mb": idle / 1e6, "loaded_mb": peak.peak / 1e6}
    finally:
        process.terminate()
        process.wait(timeout=60)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model_path(),
                        help="GGUF file (default: the default model)")
    parser.add_argument("--ctx", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--parallel", type=int, default=4, help="full-context sequences planned")
    parser.add_argument("--streams", type=int, default=16, help="concurrent requests of the loaded phase")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="about this many tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per request")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of both servers")
    parser.add_argument("--runs", type=int, default=3, help="runs per server, alternated")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")
    args = parser.parse_args()
    if "LLAMA_CPP_BIN" not in os.environ:
        parser.error("LLAMA_CPP_BIN is not set: run `eval \"$(tools/build_llama_cpp.sh)\"` first")
    rows: dict[str, list[dict[str, float]]] = {"edgeinfer": [], "llama-server": []}
    for _ in range(args.runs):
        rows["edgeinfer"].append(run_edgeinfer(args))
        rows["llama-server"].append(run_llama_server(args))
        if args.json:
            print(json.dumps({name: runs[-1] for name, runs in rows.items()}), flush=True)
    ours, peer = rows["edgeinfer"], rows["llama-server"]
    print(f"{args.model.name}: --ctx {args.ctx} x --parallel {args.parallel}, {args.streams} streams, "
          f"{args.runs} alternated runs, median (min-max)")
    print("| server | idle RSS MB | loaded peak RSS MB | plan MB (idle + KV) |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        plan = spread([r["plan_mb"] for r in runs]) if "plan_mb" in runs[0] else "-"
        idle, loaded = spread([r["idle_mb"] for r in runs]), spread([r["loaded_mb"] for r in runs])
        print(f"| {name} | {idle} | {loaded} | {plan} |")
    idle_ratio = [o["idle_mb"] / p["idle_mb"] for o, p in zip(ours, peer, strict=True)]
    within = [o["loaded_mb"] / o["plan_mb"] for o in ours]
    print(f"idle RSS edgeinfer / llama-server: {min(idle_ratio):.2f}-{max(idle_ratio):.2f}x; "
          f"loaded peak / plan: {min(within):.2f}-{max(within):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
