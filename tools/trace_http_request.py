"""Where a lone OpenAI request's time to first token goes, stamp by stamp (issue #22).

Starts ``edgeinfer serve`` (the default model, 2 threads) in a subprocess with timestamps on its
path (private methods wrapped, as tools/bench_engine_step.py does: a measurement tool, not an
API), then sends --requests streaming ``POST /v1/completions`` one at a time, --pause seconds
apart (a lone user: the server idle in between), each a distinct 64-token prompt, 4 greedy
tokens, through tools/bench_http.py's client. Printed per segment, over all but the first two
requests: the median, min and max in ms.

    python tools/trace_http_request.py [--requests 12] [--pause 0.6]
    python tools/trace_http_request.py --burst 16 [--requests 6] [--pause 0.6]

With --burst N, each of --requests rounds writes N such requests at once over N connections opened
for the round (as tools/bench_serving.py's client does) and prints, per round: when the server's ASGI calls for
them began (the first and the last, ms after the first), how many were submitted before the
engine's first step and how long that step ran (a step that took one prompt alone, while the
others had arrived, is what SchedulerConfig.burst_window_s is there to prevent), and the TTFT p50
the client read.

Segments: client write -> the ASGI app called (uvicorn's parse), -> the body read and parsed,
-> the engine's request stream started (routing done, schema, sampling parameters), -> the
scheduler actor's submission, -> the step that runs the prompt, -> its first token event, ->
the first SSE chunk written, -> the client's read of it. Both processes stamp with
time.perf_counter (CLOCK_MONOTONIC on Linux), so the stamps compare across them.
"""

from __future__ import annotations

import argparse
import inspect
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))

STAMPS = ("asgi", "parsed", "stream", "submit", "step", "token", "sse")
SEGMENTS = ("client write -> ASGI call", "ASGI call -> body parsed", "body parsed -> engine stream",
            "engine stream -> submission", "submission -> prompt's step", "step -> first token event",
            "token event -> SSE write", "SSE write -> client read", "TTFT")


def serve_traced(trace: str) -> None:
    """In the server process: wrap the stamped methods, then run `edgeinfer serve` (sys.argv)."""
    import starlette.applications

    from edgeinfer.core.events import Token
    from edgeinfer.engine import api, scheduler_actor
    from transport import openai_api

    out = open(trace, "w", buffering=1)  # noqa: SIM115 (the server's lifetime)

    def stamp(name: str) -> None:
        out.write(f"{name} {time.perf_counter():.6f}\n")

    def wrap(owner: object, name: str, before: str | None = None, after: str | None = None) -> None:
        original = getattr(owner, name)

        def sync(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            stamp(before)
            return original(*args, **kwargs)

        async def asynchronous(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if before:
                stamp(before)
            result = await original(*args, **kwargs)
            if after:
                stamp(after)
            return result

        setattr(owner, name, asynchronous if inspect.iscoroutinefunction(original) else sync)

    app_call = starlette.applications.Starlette.__call__

    async def call(self, scope, receive, send):  # noqa: ANN001, ANN202
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await app_call(self, scope, receive, send)
        stamp("asgi")
        first = True

        async def sse_send(message):  # noqa: ANN001, ANN202
            nonlocal first
            await send(message)
            if first and message["type"] == "http.response.body" and message.get("body", b"").startswith(b"data: {"):
                first = False
                stamp("sse")
        return await app_call(self, scope, receive, sse_send)

    starlette.applications.Starlette.__call__ = call
    wrap(openai_api.OpenAIApi, "_json", after="parsed")
    wrap(api.RequestStream, "_submit", before="stream")
    wrap(scheduler_actor.SchedulerActor, "_submit", before="submit")
    wrap(scheduler_actor.SchedulerActor, "_step", before="step")
    send_event, tokened = scheduler_actor.SchedulerActor._send, set()

    def send(self, event):  # noqa: ANN001, ANN202
        if isinstance(event, Token) and event.request_id not in tokened:
            tokened.add(event.request_id)
            stamp("token")
        return send_event(self, event)

    scheduler_actor.SchedulerActor._send = send
    sys.argv = ["edgeinfer", *sys.argv[1:]]
    runpy.run_module("edgeinfer.cli", run_name="__main__")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--pause", type=float, default=0.6, help="seconds between requests (the server idles)")
    parser.add_argument("--burst", type=int, default=0, metavar="N", help="rounds of N requests written together")
    args = parser.parse_args()

    import anyio
    from bench_common import free_port, wait_healthy
    from bench_http import Connection
    from bench_serving import prompt_ids

    from edgeinfer.models.loader import load_model
    from edgeinfer.models.pull import default_model_path

    model = default_model_path()
    encode = load_model(str(model)).tokenizer.encode
    port, client = free_port(), []  # client: (write, first chunk read) per request
    with tempfile.TemporaryDirectory() as tmp:
        trace, log = Path(tmp) / "trace", Path(tmp) / "server.log"
        command = [sys.executable, __file__, "serve", "--model", str(model), "--port", str(port), "--threads", "2"]
        env = {**os.environ, "EDGEINFER_CONFIG_DIR": tmp, "EDGEINFER_TRACE_FILE": str(trace)}
        with open(log, "w") as log_file:
            server = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/healthz", server, log=log)
            headers = {"Authorization": f"Bearer {(Path(tmp) / 'token').read_text().strip()}"}

            async def burst_rounds() -> None:
                for i in range(args.requests):  # each round on new connections, as bench_serving's
                    connections = [Connection("127.0.0.1", port, headers) for _ in range(args.burst)]
                    for connection in connections:
                        await connection.open()
                    name = (await connections[0].get_json("/v1/models"))["data"][0]["id"]
                    requests = [c.request_bytes("POST", "/v1/completions", {
                        "model": name, "prompt": prompt_ids(encode, f"burst-{time.time()}-{i}-{j}", 64),
                        "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True})
                        for j, c in enumerate(connections)]
                    await anyio.sleep(args.pause)
                    start, firsts = time.perf_counter(), []
                    for connection, request in zip(connections, requests, strict=True):
                        connection.write(request)

                    async def first_read(connection: Connection, start: float = start,
                                         firsts: list[float] = firsts) -> None:
                        first = None
                        async for data in connection.events():
                            if first is None and data.startswith(b"{"):
                                first = time.perf_counter() - start
                        firsts.append(first)

                    async with anyio.create_task_group() as tg:
                        for connection in connections:
                            tg.start_soon(first_read, connection)
                    if None in firsts:
                        raise RuntimeError(f"a request of round {i} got no token")
                    client.append((start, statistics.median(firsts)))
                    for connection in connections:
                        await connection.close()

            async def run() -> None:
                connection = Connection("127.0.0.1", port, headers)
                await connection.open()
                name = (await connection.get_json("/v1/models"))["data"][0]["id"]
                for i in range(args.requests):
                    body = {"model": name, "prompt": prompt_ids(encode, f"trace-{time.time()}-{i}", 64),
                            "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
                    request = connection.request_bytes("POST", "/v1/completions", body)
                    await anyio.sleep(args.pause)
                    start, first = time.perf_counter(), None
                    connection.write(request)
                    async for data in connection.events():
                        if first is None and data.startswith(b"{"):
                            first = time.perf_counter()
                    client.append((start, first))
                await connection.close()

            anyio.run(burst_rounds if args.burst else run)
        finally:
            server.terminate()
            server.wait()
        stamps: dict[str, list[float]] = {name: [] for name in STAMPS}
        for line in trace.read_text().splitlines():
            name, value = line.split()
            stamps[name].append(float(value))
    if args.burst:
        print_bursts(args, client, stamps)
        return 0
    # Each request's stamps in order; the prompt's step is the first step after its submission.
    rows = []
    for i, (start, first) in enumerate(client):
        at = {name: stamps[name][i] for name in STAMPS if name != "step"}
        at["step"] = min(t for t in stamps["step"] if t >= at["submit"])
        points = [start, *(at[name] for name in STAMPS), first]
        rows.append([(b - a) * 1e3 for a, b in zip(points[:-1], points[1:], strict=True)] + [(first - start) * 1e3])
    print(f"{args.requests} lone requests {args.pause} s apart, the first two left out; ms median (min-max)")
    for j, segment in enumerate(SEGMENTS):
        values = [row[j] for row in rows[2:]]
        print(f"{segment:30s} {statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})")
    return 0


def print_bursts(args: argparse.Namespace, rounds: list[tuple[float, float]], stamps: dict[str, list[float]]) -> None:
    """Per round of --burst requests: the server's ASGI calls, the first step, the client's TTFT p50."""
    print(f"{args.requests} rounds of {args.burst} requests written together, {args.pause} s apart")
    print("round  ASGI calls from the first, ms  submitted before the first step  first step ms  TTFT p50 ms")
    for i, (start, ttft) in enumerate(rounds):
        end = rounds[i + 1][0] if i + 1 < len(rounds) else float("inf")
        at = {name: [t for t in values if start <= t < end] for name, values in stamps.items()}
        first = at["asgi"][0]
        steps = at["step"]
        joined = sum(1 for t in at["submit"] if t < steps[0])
        print(f"{i:5d}  {0.0:.1f} .. {(at['asgi'][-1] - first) * 1e3:4.1f} (second {(at['asgi'][1] - first) * 1e3:.1f})"
              f"  {joined:31d}  {(steps[1] - steps[0]) * 1e3:13.1f}  {ttft * 1e3:11.1f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve_traced(os.environ["EDGEINFER_TRACE_FILE"])
    else:
        sys.exit(main())
