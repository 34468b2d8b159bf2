"""What the HTTP path adds to one request's TTFT: `edgeinfer serve` in a subprocess, --requests
streaming completions one after another, each timed at the client (send to first token) and by
the server itself (the final chunk's `timings.ttft_s`, arrival at the engine to first token); the
difference is the HTTP path's share: the request's parse before the engine sees it, the first
chunk's way out and the client's read.

--client httpx reads through httpx (what the openai SDK uses); --client lean through
tools/bench_http.py; --client websocket sends the same prompts over the edgeinfer/1 websocket
(transport.client, what the chat page and the desktop clients use) on the same port.
--compute-nice is passed to the server (RuntimeConfig.compute_nice), so alternated invocations
show what the compute threads' priority does to a client's read. --prompt-tokens 4: a prompt
whose first token is ready before the client's delayed ACK would fire (see bind_socket).

    python tools/bench_http_overhead.py --client httpx --compute-nice 0
    python tools/bench_http_overhead.py --client websocket --prompt-tokens 4
    python tools/bench_http_overhead.py --burst 16 --requests 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_http import Connection  # noqa: E402
from bench_serving import prompt_ids, served  # noqa: E402

from edgeinfer.config import RuntimeConfig  # noqa: E402
from edgeinfer.models.loader import load_model  # noqa: E402
from edgeinfer.models.pull import default_model_path  # noqa: E402
from transport.client import Client, connect  # noqa: E402


async def httpx_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]) -> tuple[float, dict]:
    """(client TTFT s, timings) of one streamed request through httpx."""
    sent, first, timings = time.perf_counter(), None, {}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter()
                if '"timings"' in line:
                    timings = json.loads(line[6:])["timings"]
    assert first is not None and timings, "no token or no timings"
    return first - sent, timings


async def lean_read(connection: Connection, sent: float) -> tuple[float, dict]:
    """(client TTFT s from ``sent``, timings) of the streamed answer on ``connection``."""
    first, timings = None, {}
    async for data in connection.events():
        if data.startswith(b"{"):
            first = first or time.perf_counter()
            if b'"timings"' in data:
                timings = json.loads(data)["timings"]
    assert first is not None and timings, "no token or no timings"
    return first - sent, timings


async def lean_request(connection: Connection, request: bytes) -> tuple[float, dict]:
    sent = time.perf_counter()
    connection.write(request)
    return await lean_read(connection, sent)


async def websocket_request(client: Client, prompt_ids: list[int], args: argparse.Namespace) -> tuple[float, dict]:
    sent, first, timings = time.perf_counter(), None, {}
    async for event in client.generate(prompt_ids, max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True):
        if event["type"] == "token":
            first = first or time.perf_counter()
        elif event["type"] == "done":
            timings = event
    assert first is not None and timings, "no token or no timings"
    return first - sent, timings


async def measure(port: int, headers: dict[str, str], args: argparse.Namespace, encode) -> list[tuple[float, float]]:  # noqa: ANN001
    """(client TTFT, server TTFT) per request, the first two (warm-up) left out."""
    if args.client == "websocket":
        token = headers["Authorization"].removeprefix("Bearer ")
        async with connect(f"ws://127.0.0.1:{port}/ws", token) as client:
            rows = [await websocket_request(client, prompt_ids(encode, f"{time.time()}-{i}", args.prompt_tokens), args)
                    for i in range(args.requests + 2)]
        return [(ttft, timings["ttft_s"]) for ttft, timings in rows[2:]]
    if args.burst > 1:
        return await measure_bursts(port, headers, args, encode)
    url = f"http://127.0.0.1:{port}/v1/completions"
    client = httpx.AsyncClient(timeout=600)
    connection = Connection("127.0.0.1", port, headers)
    await connection.open()
    try:
        model = (await connection.get_json("/v1/models"))["data"][0]["id"]
        rows = []
        for i in range(args.requests + 2):
            body = {"model": model, "prompt": prompt_ids(encode, f"{time.time()}-{i}", args.prompt_tokens),
                    "max_tokens": args.new_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            if args.client == "httpx":
                ttft, timings = await httpx_request(client, url, body, headers)
            else:
                request = connection.request_bytes("POST", "/v1/completions", body)
                ttft, timings = await lean_request(connection, request)
            rows.append((ttft, timings["ttft_s"]))
        return rows[2:]
    finally:
        await client.aclose()
        await connection.close()


async def burst_stream(connection: Connection, sent: float, results: list[tuple[float, float]]) -> None:
    ttft, timings = await lean_read(connection, sent)
    results.append((ttft, timings["ttft_s"]))


async def measure_bursts(port: int, headers: dict[str, str], args: argparse.Namespace,
                         encode) -> list[tuple[float, float]]:  # noqa: ANN001
    """--requests rounds of --burst requests written at once on as many open connections (as
    tools/bench_serving.py's rounds do); (client TTFT, server TTFT) per request, the first round
    (warm-up) left out. A request the server parses too late for the idle engine's first step
    shows a gap of about that step."""
    connections = [Connection("127.0.0.1", port, headers) for _ in range(args.burst)]
    rows: list[tuple[float, float]] = []
    try:
        for connection in connections:
            await connection.open()
        model = (await connections[0].get_json("/v1/models"))["data"][0]["id"]
        for r in range(args.requests + 1):
            requests = [c.request_bytes("POST", "/v1/completions", {
                "model": model, "prompt": prompt_ids(encode, f"{time.time()}-{r}-{i}", args.prompt_tokens),
                "max_tokens": args.new_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}) for i, c in enumerate(connections)]
            sent, results = time.perf_counter(), []
            for connection, request in zip(connections, requests, strict=True):
                connection.write(request)
            async with anyio.create_task_group() as tg:
                for connection in connections:
                    tg.start_soon(burst_stream, connection, sent, results)
            if r:
                rows += results
        return rows
    finally:
        for connection in connections:
            await connection.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=default_model_path(), type=Path, help="GGUF file (default: the default model)")
    p.add_argument("--client", default="lean", choices=("lean", "httpx", "websocket"))
    p.add_argument("--requests", type=int, default=28, help="timed requests, one after another (default: 28)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--burst", type=int, default=1,
                   help="lean client: write this many requests at once per round, --requests rounds (default: 1)")
    p.add_argument("--threads", type=int, default=None, help="server threads (default: one per core)")
    p.add_argument("--compute-nice", type=int, default=RuntimeConfig.compute_nice)
    args = p.parse_args()
    if args.burst > 1 and args.client != "lean":
        p.error("--burst needs --client lean")
    encode = load_model(str(args.model)).tokenizer.encode
    # The server as bench_serving starts it, its --parallel room for a burst.
    server = argparse.Namespace(**vars(args), streams=[max(4, args.burst)], linear_path="auto", kv_dtype="auto",
                                cpu_activations=RuntimeConfig.cpu_activations)
    with served("openai", server) as (port, headers):
        rows = anyio.run(measure, port, headers, args, encode)
    client_ms = [c * 1e3 for c, _ in rows]
    server_ms = [s * 1e3 for _, s in rows]
    gaps = sorted(c - s for c, s in zip(client_ms, server_ms, strict=True))
    burst = f", bursts of {args.burst}" if args.burst > 1 else ""
    print(f"{args.model.name}: {len(rows)} requests{burst}, client {args.client}, compute-nice {args.compute_nice}: "
          f"client TTFT {statistics.median(client_ms):.1f} ms, server TTFT {statistics.median(server_ms):.1f} ms, "
          f"HTTP share median {statistics.median(gaps):.2f} ms (min {gaps[0]:.2f}, "
          f"p90 {gaps[int(0.9 * (len(gaps) - 1))]:.2f}, max {gaps[-1]:.2f})")


if __name__ == "__main__":
    main()
