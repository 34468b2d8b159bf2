"""Soak test: `edgeinfer serve` under mixed load for a given time, on loopback.

Starts the real server (default model, its own token in a temporary config dir) and runs, all at
once: clients that stream requests to the end (generate and chat, 1-64 tokens, some n=2), clients
that cancel a request 0-300 ms after sending it, clients that drop the connection mid-stream,
clients that send malformed frames, and a /healthz poller. Every connection's frames are checked
against the life-cycle invariant of docs/PROTOCOL.md (accepted, tokens, exactly one terminal per
request). Reported: requests served by finish reason, errors by code, invariant violations,
/healthz failures, and the server's RSS after the warm-up and at the end.

Fails (exit 1) on any internal_error / engine_closed, a violated invariant, a /healthz that is
not 200, or RSS growth over 5% from the end of the warm-up.

    python tools/soak.py --minutes 30 [--warmup-s 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me about the sea.", "Count to twenty:", "Write a haiku about rain.", "What is 17 * 3?",
           "List five fruits.", "Once upon a time", "Explain a paged KV cache in one line."]
BAD_FRAMES: list[str | bytes] = [
    "not json", "[1, 2]", '{"type": "launch"}', '{"type": "generate", "id": "b", "prompt": "x", "extra": 1}',
    '{"type": "generate", "id": "b", "prompt": "x", "params": {"top_k": 1e400}}',
    '{"type": "generate", "id": "b", "prompt": "x", "params": {"top_k": 100000000000000000000000000000}}',
    '{"type": "generate", "id": "b", "prompt": "x", "params": {"length_penalty": -1e308, "beam_width": 2}}',
    '{"type": "generate", "id": "\\ud800", "prompt": "x"}', '{"type": "generate", "id": "b", "prompt": "\\udfff"}',
    '{"type": "cancel", "id": "never-sent"}', "[" * 50_000, b"\xc1", b"\x81\xa4type\xa1\xff",
    '{"type": "generate", "id": "b", "prompt": "x", "params": {"max_tokens": 10000000}}',
]


class Tally:
    """What the load saw, over all clients."""

    def __init__(self) -> None:
        self.finish = collections.Counter[str]()
        self.errors = collections.Counter[str]()
        self.violations: list[str] = []
        self.disconnects = 0
        self.health_failures: list[str] = []
        self.tokens = 0

    def check(self, frames: list[dict[str, Any]], sent: list[str]) -> None:
        """The life-cycle invariant over one connection whose ids were used once each."""
        by_id: dict[str, list[str]] = collections.defaultdict(list)
        for frame in frames:
            if frame["type"] == "error":
                self.errors[frame["code"]] += 1
            if frame["type"] == "done":
                self.finish[frame["finish_reason"]] += 1
            if frame["type"] == "token":
                self.tokens += len(frame["token_ids"])
            if frame.get("id") is not None and not (frame["type"] == "error" and frame["code"] == "unknown_id"):
                by_id[frame["id"]].append(frame["type"])
        for rid in sent:
            kinds = by_id.get(rid, [])
            terminal = [k for k in kinds if k in ("done", "error")]
            if len(terminal) != 1 or kinds[-1] not in ("done", "error"):
                self.violations.append(f"{rid}: {kinds}")
            elif kinds[0] != "accepted" and kinds != ["error"]:
                self.violations.append(f"{rid}: {kinds}")


async def receive(ws: ClientConnection, timeout_s: float = 120.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


async def open_client(url: str, token: str) -> ClientConnection:
    ws = await connect(url, max_size=None)
    await ws.send(json.dumps({"type": "hello", "version": "edgeinfer/1", "token": token, "client": "soak"}))
    welcome = await receive(ws)
    if welcome["type"] != "welcome":
        raise RuntimeError(f"hello refused: {welcome}")
    return ws


def random_request(rng: random.Random, rid: str) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.15:
        params["n"] = 2
    if rng.random() < 0.3:
        return {"type": "chat", "id": rid, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "params": params}
    return {"type": "generate", "id": rid, "prompt": rng.choice(PROMPTS), "params": params}


async def read_terminals(ws: ClientConnection, frames: list[dict[str, Any]], ids: set[str]) -> None:
    while ids:
        frame = await receive(ws)
        frames.append(frame)
        if frame["type"] in ("done", "error") and frame.get("code") != "unknown_id":
            ids.discard(frame["id"])


async def client(kind: str, url: str, token: str, tally: Tally, stop: float, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < stop:
        ws = await open_client(url, token)
        frames: list[dict[str, Any]] = []
        sent: list[str] = []
        try:
            for _ in range(rng.randint(1, 8)):  # requests per connection
                rid = f"{kind}{seed}-{n}"
                n += 1
                if kind == "bad":
                    await ws.send(rng.choice(BAD_FRAMES))
                    frames.append(await receive(ws))
                    await asyncio.sleep(rng.uniform(0.01, 0.1))
                    continue
                sent.append(rid)
                await ws.send(json.dumps(random_request(rng, rid)))
                if kind == "cancel":
                    await asyncio.sleep(rng.uniform(0, 0.3))
                    await ws.send(json.dumps({"type": "cancel", "id": rid}))
                elif kind == "disconnect":
                    await asyncio.sleep(rng.uniform(0, 0.5))
                    tally.disconnects += 1
                    sent.pop()  # its terminal frame never comes: the server cancels it
                    break
                await read_terminals(ws, frames, {rid})
                await asyncio.sleep(rng.uniform(0, 0.2))
        finally:
            await ws.close()
        tally.check(frames, sent)


async def health_poller(port: int, tally: Tally, stop: float) -> None:
    while time.monotonic() < stop:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        raw = await reader.read()
        writer.close()
        if not raw.startswith(b"HTTP/1.1 200"):
            tally.health_failures.append(raw[:200].decode(errors="replace"))
        await asyncio.sleep(2.0)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(url: str, token: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"edgeinfer serve exited with {proc.returncode}")
        try:
            ws = await open_client(url, token)
            await ws.close()
            return
        except (OSError, InvalidStatus, ConnectionClosed):
            await asyncio.sleep(0.5)
    raise RuntimeError("edgeinfer serve did not come up")


async def soak(args: argparse.Namespace, url: str, port: int, token: str, pid: int) -> dict[str, Any]:
    tally = Tally()
    start = time.monotonic()
    stop = start + args.minutes * 60
    mix = ["stream"] * args.streams + ["cancel"] * 2 + ["disconnect"] * 2 + ["bad"]
    tasks = [asyncio.create_task(client(kind, url, token, tally, stop, i)) for i, kind in enumerate(mix)]
    tasks.append(asyncio.create_task(health_poller(port, tally, stop)))
    await asyncio.sleep(min(args.warmup_s, args.minutes * 60 / 2))
    rss_start = rss_mib(pid)
    samples = [rss_start]
    while time.monotonic() < stop:
        await asyncio.sleep(min(10.0, max(0.0, stop - time.monotonic())))
        samples.append(rss_mib(pid))
    await asyncio.gather(*tasks)
    rss_end = rss_mib(pid)
    return {"minutes": args.minutes, "clients": len(mix), "requests_done": dict(tally.finish),
            "requests_served": sum(tally.finish.values()), "tokens_streamed": tally.tokens,
            "errors_by_code": dict(tally.errors), "disconnects": tally.disconnects,
            "violations": tally.violations[:20], "health_failures": tally.health_failures[:5],
            "rss_mib_after_warmup": round(rss_start, 1), "rss_mib_end": round(rss_end, 1),
            "rss_mib_max": round(max(samples + [rss_end]), 1),
            "rss_growth": round(rss_end / rss_start - 1, 4), "wall_s": round(time.monotonic() - start, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=60.0, help="load before the starting RSS is taken")
    parser.add_argument("--streams", type=int, default=6, help="clients streaming to the end")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    port = free_port()
    url = f"ws://127.0.0.1:{port}/ws"
    with tempfile.TemporaryDirectory() as config_dir:
        env = {**os.environ, "EDGEINFER_CONFIG_DIR": config_dir}
        proc = subprocess.Popen([sys.executable, "-m", "edgeinfer.cli", "serve", "--port", str(port)],
                                cwd=ROOT, env=env)
        try:
            token_file = Path(config_dir) / "token"
            for _ in range(600):
                if token_file.exists() and token_file.stat().st_size:
                    break
                time.sleep(0.1)
            token = token_file.read_text().strip()
            asyncio.run(wait_ready(url, token, proc))
            report = asyncio.run(soak(args, url, port, token, proc.pid))
            report["server_alive"] = proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    bad = {c: n for c, n in report["errors_by_code"].items() if c in ("internal_error", "engine_closed")}
    ok = not bad and not report["violations"] and not report["health_failures"] and report["server_alive"] \
        and report["rss_growth"] <= 0.05
    print("PASS" if ok else f"FAIL: {bad or ''} {len(report['violations'])} violations, "
          f"{len(report['health_failures'])} health failures, RSS growth {report['rss_growth']:.1%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
