"""One HTTP front-end: uvicorn (uvloop where installed, and the connection-capping h11 protocol
of http_protocol.py) serving `create_app` over a `CoreClient`. `nanovllm serve` runs one in its own process, or `--api-server-count N` of them in
child processes, each on its own SO_REUSEPORT socket bound to the same port (the kernel spreads
connections across them).

When the core dies the client fails every in-flight request at once (503 / an SSE error event);
the front-end keeps answering (`/health` is 503) for DEAD_LINGER_S so health checkers see it,
then exits with status 1. SIGINT/SIGTERM: graceful (see `GracefulServer`), status 0.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from nanovllm.engine.core import CoreAddresses, CoreInfo, die_with_parent
from nanovllm.entrypoints.limits import ServerLimits

if TYPE_CHECKING:
    from nanovllm.entrypoints.tools import ParserConfig

logger = logging.getLogger("nanovllm")

DEAD_LINGER_S = 2.0


@dataclass
class FrontendConfig:
    addresses: CoreAddresses
    info: CoreInfo
    model_name: str
    api_key: str | None
    host: str
    port: int
    shutdown_timeout: float
    log_level: str
    access_log: bool
    max_prompt_chars: int | None
    stream_write_timeout: float
    limits: ServerLimits
    parsers: "ParserConfig | None" = None  # --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser


def check_port_free(host: str, port: int) -> None:
    """ValueError where another process listens on (host, port), also one that set SO_REUSEPORT
    (front-ends bound with it would share that process's port, and its clients), or where the
    host is not an address of this machine. Port 0 (any free port) checks the host alone."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT, so several processes can listen on one port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_frontend(cfg: FrontendConfig, sock: socket.socket | None = None,
                 core_alive: Callable[[], bool] | None = None) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or the core's death (returns 1)."""
    from nanovllm.engine.core_client import CoreClient
    from nanovllm.entrypoints.http_protocol import uvicorn_options
    from nanovllm.entrypoints.server import GracefulServer, create_app

    server_box: list[GracefulServer] = []

    def on_dead() -> None:
        def stop() -> None:
            if server_box:
                server_box[0].should_exit = True

        threading.Timer(DEAD_LINGER_S, stop).start()

    client = CoreClient(cfg.addresses, cfg.info, core_alive=core_alive, on_dead=on_dead)
    caught: list[int] = []
    previous = {}
    server = None
    try:
        app = create_app(client, cfg.model_name, api_key=cfg.api_key, limits=cfg.limits,
                         max_prompt_chars=cfg.max_prompt_chars, stream_write_timeout=cfg.stream_write_timeout,
                         parsers=cfg.parsers)
        server = GracefulServer(client, app, cfg.shutdown_timeout, host=cfg.host, port=cfg.port,
                                log_level=cfg.log_level, access_log=cfg.access_log, **uvicorn_options(cfg.limits))
        server_box.append(server)
        def stop(sig: int, frame: object) -> None:
            """A signal before uvicorn's own handlers are in stops the server as theirs would; and
            uvicorn re-raises the signal it handled after shutting down, which lands here too."""
            caught.append(sig)
            server.handle_exit(sig, frame)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop)
        if sock is not None:
            logger.info("front-end pid %d serving http://%s:%d", os.getpid(), cfg.host, cfg.port)
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        died = client.error is not None
        client.shutdown(abort=True)
    if died:
        logger.error("the engine core died: this front-end exits with status 1")
        return 1
    return 0 if (server is not None and server.started) or caught else 1


def frontend_process_main(cfg: FrontendConfig, parent_pid: int) -> None:
    """Entry point of a front-end child process (`--api-server-count` > 1)."""
    os.setsid()  # the parent forwards SIGTERM; a terminal's Ctrl-C goes to the parent alone
    die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    sock = reuseport_socket(cfg.host, cfg.port)
    status = run_frontend(cfg, sock=sock)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # nothing left to clean up; skips waiting on library threads at exit
