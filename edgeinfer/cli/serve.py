"""Flags of `edgeinfer serve`, `edgeinfer daemon ...` and `edgeinfer chat`; nothing else reads argv.

edgeinfer.cli.main calls `serve_main(argv)`, `daemon_main(argv)` and `chat_main(args)`; the
daemon's background process runs `python -m edgeinfer.cli serve ... --daemon-state DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from edgeinfer.cli.event_loop import run_coroutine
from edgeinfer.cli.options import (
    HelpFormatter,
    add_log_level,
    add_runtime_args,
    model_path,
    positive_int,
    runtime_config,
    setup_logging,
)
from edgeinfer.config import SchedulerConfig
from edgeinfer.models.host_memory import return_large_frees_to_the_os
from transport import auth, daemon
from transport.server import ServerConfig

DEFAULT_PORT = 8765
API_KEY_ENV = "EDGEINFER_API_KEY"


def _serve_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter,
                                description="HTTP server: the OpenAI API (/v1), the edgeinfer/1 websocket, the web "
                                            "chat page.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    add_runtime_args(p)
    p.add_argument("--speculative", choices=("off", "ngram"), default="off",
                   help="prompt-lookup speculative decoding while at most 2 requests run (helps answers "
                        "that copy the prompt: rewrites, edits, quotes)")
    p.add_argument("--draft-model", metavar="PATH",
                   help="speculative decoding with this model drafting (same vocabulary) while at most 2 "
                        "requests run, e.g. the int4 GGUF for an int8 or bf16 checkpoint of the same model")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens per model step, shared by running decodes and prompt chunks (default: 128 on "
                        "the CPU, 512 on a GPU); fewer cut the time to first token under load")
    p.add_argument("--max-connections", type=int, default=128, help="websocket connections open at once")
    p.add_argument("--max-requests-per-connection", type=int, default=16,
                   help="requests one websocket connection may have in flight")
    p.add_argument("--max-frame-bytes", type=int, default=1 << 20, help="largest websocket frame accepted")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    p.add_argument("--allow-origin", action="append", default=[], help="extra browser Origin to allow")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"a key the OpenAI API (/v1) accepts as 'Authorization: Bearer KEY', besides the "
                        f"server's token; ${API_KEY_ENV} when not given")
    add_log_level(p)
    p.add_argument("--daemon-state", help=argparse.SUPPRESS)  # set by `edgeinfer daemon start`
    return p


def serve_main(argv: list[str]) -> int:
    from transport.service import ServiceConfig, run_service

    args = _serve_parser("edgeinfer serve").parse_args(argv)
    return_large_frees_to_the_os()  # also when the daemon starts this module directly
    # The daemon's log file records what the server does unless a level was asked for.
    setup_logging("info" if args.daemon_state and args.log_level == "warning" else args.log_level)
    try:
        server = ServerConfig(token=auth.load_or_create_token(), host=args.host, port=args.port,
                              max_connections=args.max_connections,
                              max_requests_per_connection=args.max_requests_per_connection,
                              max_frame_bytes=args.max_frame_bytes, drain_timeout_s=args.drain_timeout,
                              allowed_origins=tuple(args.allow_origin),
                              api_keys=tuple(k for k in (args.api_key or os.environ.get(API_KEY_ENV),) if k))
        if args.draft_model and args.speculative != "off":
            raise ValueError("--speculative ngram and --draft-model are two drafters: choose one")
        config = ServiceConfig(server, str(model_path(args.model)), runtime_config(args),
                               SchedulerConfig(speculative="draft" if args.draft_model else args.speculative,
                                               max_num_batched_tokens=args.max_num_batched_tokens),
                               state_dir=args.daemon_state,
                               draft_model_path=str(model_path(args.draft_model)) if args.draft_model else None)
        return run_coroutine(run_service(config))
    except (ValueError, OSError, RuntimeError) as exc:  # bad flags, port in use, token file, daemon lock
        print(f"edgeinfer serve: error: {exc}", file=sys.stderr)
        return 2


def _daemon_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgeinfer daemon", description="The server in the background.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("start", help="start in the background (same flags as `edgeinfer serve`)",
                           add_help=False)
    start.add_argument("--wait", type=float, default=180.0, help="seconds to wait for the model to load")
    stop = sub.add_parser("stop", help="stop, letting in-flight requests finish", formatter_class=HelpFormatter)
    stop.add_argument("--timeout", type=float, default=40.0, help="seconds to wait before killing it")
    status = sub.add_parser("status", help="is it running, where, and the chat page URL",
                            formatter_class=HelpFormatter)
    logs = sub.add_parser("logs", help="print the log", formatter_class=HelpFormatter)
    logs.add_argument("-n", "--lines", type=int, default=50, help="how many of the last lines")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing lines as they are written")
    for command in (stop, status, logs):
        add_log_level(command)
    return parser


def daemon_main(argv: list[str]) -> int:
    parser = _daemon_parser()
    args, rest = parser.parse_known_args(argv)
    setup_logging(getattr(args, "log_level", "warning"))  # start: the daemon's server logs to its own file
    directory = daemon.state_dir()
    try:
        if args.action == "start":
            _serve_parser("edgeinfer daemon start").parse_args(rest)  # bad flags fail here, not in the log
            state = daemon.start(rest, directory, timeout_s=args.wait)
            log_path = directory / daemon.LOG_FILE
            print(f"edgeinfer daemon started: pid {state.pid}, {state.url}, log {log_path}")
            return 0
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.action == "stop":
            state = daemon.stop(directory, timeout_s=args.timeout)
            print("edgeinfer daemon: not running" if state is None
                  else f"edgeinfer daemon stopped (pid {state.pid})")
            return 0
        if args.action == "status":
            return _status(directory)
        log_path = directory / daemon.LOG_FILE
        print(daemon.tail(log_path, args.lines))
        if args.follow:
            daemon.follow(log_path)
        return 0
    except daemon.DaemonError as exc:
        print(f"edgeinfer daemon: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _status(directory: Path) -> int:
    state = daemon.running(directory)
    if state is None:
        print("edgeinfer daemon: not running")
        return 3  # LSB status code: program is not running
    health = "healthy" if daemon.healthy(state) else "not answering /healthz"
    print(f"edgeinfer daemon: running, pid {state.pid}, {state.url}, model {state.model}, {health}")
    # The page URL carries the token in its fragment: printed only to this user's terminal.
    print(f"chat page: {state.http}/#token={auth.load_or_create_token()}")
    return 0


def chat_main(args: argparse.Namespace) -> int:
    """`edgeinfer chat` (flags parsed by edgeinfer.cli.main: max_tokens, temperature and model flags)."""
    from transport.chat import chat_repl, open_chat_backend, read_lines

    # Only what the user typed: the engine fills the rest as for every front end (GENERATION_DEFAULTS).
    params = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}
    use_daemon = not args.no_daemon

    async def main() -> int:
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        answering: list[asyncio.Task[str]] = []

        def on_sigint() -> None:  # stop the answer if one streams, else quit
            (answering[0] if answering else main_task).cancel()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        model = None if daemon.running() and use_daemon else str(model_path(args.model))
        async with open_chat_backend(model, runtime_config(args), use_daemon) as backend:
            def on_answer(task: asyncio.Task[str] | None) -> None:
                answering[:] = [task] if task is not None else []

            return await chat_repl(backend, params, read_lines(), on_answer=on_answer)

    try:
        return run_coroutine(main())
    except asyncio.CancelledError:
        print()
        return 130
