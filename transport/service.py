"""The server as a process: open the engine, load the token, listen, drain on SIGTERM/SIGINT.

`run_service` is what `edgeinfer serve` and the daemon's background process run. In daemon mode
(a state dir given) it also holds the state dir's lock for its whole life and publishes where it
listens (daemon.json, written atomically once the socket is bound, removed on a clean exit), so
`edgeinfer daemon status` and `edgeinfer chat` can find it; see transport.daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.config import RuntimeConfig, SchedulerConfig
from transport import auth, daemon
from transport.server import Server, ServerConfig, bind_socket

log = logging.getLogger("edgeinfer.service")


@dataclass(frozen=True)
class ServiceConfig:
    server: ServerConfig
    model_path: str
    runtime: RuntimeConfig = RuntimeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    state_dir: str | None = None  # daemon mode
    draft_model_path: str | None = None  # with scheduler.speculative "draft"


@contextlib.asynccontextmanager
async def open_engine(model_path: str, runtime: RuntimeConfig, scheduler: SchedulerConfig | None = None,
                      draft_model_path: str | None = None) -> AsyncIterator[tuple[Any, str]]:
    """(engine, model name), started."""
    from edgeinfer.engine.api import Engine, EngineConfig  # torch loads with the engine, not with the CLI

    config = EngineConfig(str(model_path), runtime, scheduler or SchedulerConfig(), draft_model_path=draft_model_path)
    async with Engine(config) as engine:
        yield engine, Path(model_path).name


def freeze_startup_heap() -> int:
    """Move every object alive once the model is up (~177,000 with the default model: torch's,
    the tokenizer's, the server's) out of the garbage collector's reach; returns how many. A full
    collection traversed them all: 69-126 ms with every stream stalled behind it (the event loop
    holds the GIL), once a minute or so under load; frozen, it walks only what came after. What is
    garbage now is collected first; frozen objects are still freed by reference counting."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def run_service(config: ServiceConfig) -> int:
    state_dir = Path(config.state_dir) if config.state_dir else None
    lock = daemon.acquire_lock(state_dir) if state_dir else None  # raises DaemonError if one runs
    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda sig=sig: (received.append(sig), stop.set()))
    try:
        # Bound before the model loads (which takes a while), so a port in use fails at once, naming it.
        sock = bind_socket(config.server.host, config.server.port)
        log.info("loading %s", config.model_path)
        async with open_engine(config.model_path, config.runtime, config.scheduler,
                               config.draft_model_path) as (engine, name):
            async with Server(engine, config.server, name, sock) as server:
                freeze_startup_heap()
                if state_dir is not None:
                    daemon.write_state(state_dir, daemon.DaemonState(
                        pid=os.getpid(), host=config.server.host, port=server.port, model=name))
                if engine.memory_plan is not None:
                    print(f"edgeinfer: memory plan: {engine.memory_plan.describe()}", flush=True)
                print(f"edgeinfer: serving {name} on {server.url}; chat page "
                      f"http://{config.server.host}:{server.port}/#token=<token in {auth.token_path()}>",
                      flush=True)
                await stop.wait()
                log.info("stopping: draining in-flight requests (up to %g s)", config.server.drain_timeout_s)
                await server.drain()
        log.info("stopped")
        if received and received[0] == signal.SIGINT:  # Ctrl-C: drained like SIGTERM, said and 130
            print("edgeinfer serve: interrupted; in-flight requests were drained", file=sys.stderr, flush=True)
            return 130
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if state_dir is not None:
            daemon.clear_state(state_dir)
        if lock is not None:
            lock.close()
