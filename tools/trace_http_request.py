"""Where a lone OpenAI request's time to first token goes, stamp by stamp (issue #22).

Starts ``edgeinfer serve`` (the default model, 2 threads) in a subprocess with timestamps on its
path (private methods wrapped, as tools/bench_engine_step.py does: a measurement tool, not an
API), then sends --requests streaming ``POST /v1/completions`` one at a time, --pause seconds
apart (a lone user: the server idle in between), each a distinct 64-token prompt, 4 greedy
tokens, through tools/bench_http.py's client. Printed per segment, over all but the first two
requests: the median, min and max in ms.

    python tools/trace_http_request.py [--requests 12] [--pause 0.6]

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

            anyio.run(run)
        finally:
            server.terminate()
            server.wait()
        stamps: dict[str, list[float]] = {name: [] for name in STAMPS}
        for line in trace.read_text().splitlines():
            name, value = line.split()
            stamps[name].append(float(value))
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


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        serve_traced(os.environ["EDGEINFER_TRACE_FILE"])
    else:
        sys.exit(main())
