"""uvicorn's h11 protocol with a connection cap and a header timeout.

uvicorn keeps a connection that never sends a request open forever, and its
`limit_concurrency` answers 503 only once a request arrives, so idle sockets pile up until the
process runs out of file descriptors and nothing (not even /health) gets in. This subclass
turns a connection away at accept when `max_connections` are open (a 503 with OpenAI's error
body and `Retry-After`, then close), and closes a connection that has not sent a complete
request line and headers within `timeout_header` seconds of connecting or of its previous
response (slow or stalled clients). Idle keep-alive connections are closed by uvicorn after
`timeout_keep_alive`; header size is bounded by h11 (`h11_max_incomplete_event_size`).

It also rate-limits the event loop's log of accept() failures (EMFILE and the like): asyncio
logs one per failed accept with a traceback.
"""
from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanovllm.entrypoints.guard import LogThrottle, json_error_bytes
from nanovllm.entrypoints.limits import ServerLimits

logger = logging.getLogger("nanovllm.server")

_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
RETRY_AFTER_S = 1


def _over_capacity_response(max_connections: int) -> bytes:
    body = json_error_bytes(503, f"the server has {max_connections} connections open, its limit; retry shortly",
                            "service_unavailable", "too_many_connections")
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def guarded_h11_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """An H11Protocol class applying `limits` (pass it as uvicorn's `http` option)."""
    throttle = LogThrottle(logger, limits.log_interval)
    over_capacity = _over_capacity_response(limits.max_connections)

    def exception_handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS:
            throttle.warning("accept", "%s: %s (raise the open-file limit or lower --max-connections)",
                             context.get("message", "accept failed"), exc)
            return
        loop.default_exception_handler(context)

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.loop.get_exception_handler() is not exception_handler:
                self.loop.set_exception_handler(exception_handler)
            self._header_timer: asyncio.TimerHandle | None = None
            self._turned_away = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                self._turned_away = True
                self.transport = transport
                throttle.warning("connections", "turned a connection away: %d connections open (--max-connections)",
                                 len(self.connections))
                transport.write(over_capacity)
                transport.close()
                return
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if not self._turned_away:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._turned_away:
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(limits.timeout_header, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                throttle.warning("header_timeout", "closed a connection that sent no complete request headers "
                                 "within %g s (--timeout-header)", limits.timeout_header)
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_options(limits: ServerLimits) -> dict:
    """Options for uvicorn.Config (or GracefulServer) that apply `limits`. uvicorn's own
    `limit_concurrency` is left off: the protocol's cap at accept supersedes it."""
    return dict(
        http=guarded_h11_protocol(limits),
        timeout_keep_alive=limits.timeout_keep_alive,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        backlog=limits.backlog,
    )
