"""uvicorn's h11 protocol with a connection cap, idle-connection eviction and a header timeout.

uvicorn keeps a connection that never sends a request open forever, and its
`limit_concurrency` answers 503 only once a request arrives, so idle sockets pile up until the
process runs out of file descriptors and nothing (not even /health) gets in. This subclass
holds open connections to `max_connections`. When a new one arrives at the cap, the oldest
idle connection is closed to make room: first one that has not completed a request's headers
since it connected, else one idle between keep-alive requests. So a flood of silent sockets
cannot lock real clients out: a real client's connection sends its request within
milliseconds and is then no longer idle, while the flood's sockets evict each other. Only when
every connection is busy with a request is the new one turned away: a 503 with OpenAI's error
body and `Retry-After`, then the write side is shut and the socket closed a moment later
(closing at once could reset the connection before the client reads the 503).

A connection must also send a complete request line and headers within `timeout_header`
seconds of connecting or of its previous response (slow or stalled clients are closed). Idle
keep-alive connections are closed by uvicorn after `timeout_keep_alive`; header size is bounded
by h11 (`h11_max_incomplete_event_size`).

It also rate-limits the event loop's log of accept() failures (EMFILE and the like): asyncio
logs one per failed accept, with a traceback.
"""
from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanovllm.entrypoints.guard import LogThrottle, json_error_bytes
from nanovllm.entrypoints.limits import ServerLimits

logger = logging.getLogger("nanovllm.server")

_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
RETRY_AFTER_S = 1
LINGER_S = 1.0  # a turned-away socket stays half-open this long, so the client can read the 503


def _over_capacity_response(max_connections: int) -> bytes:
    body = json_error_bytes(f"all {max_connections} connections this server takes are busy; retry shortly",
                            "service_unavailable", "too_many_connections")
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def accept_error_handler(throttle: LogThrottle) -> Callable[[asyncio.AbstractEventLoop, dict], None]:
    """An event-loop exception handler that logs running out of file descriptors through
    `throttle` and passes everything else to the loop's default handler."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_FDS:
            throttle.warning("accept", "%s: %s (raise the open-file limit or lower --max-connections)",
                             context.get("message", "accept failed"), exc)
            return
        loop.default_exception_handler(context)

    return handler


def guarded_h11_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """An H11Protocol class applying `limits` (pass it as uvicorn's `http` option)."""
    throttle = LogThrottle(logger, limits.log_interval)
    over_capacity = _over_capacity_response(limits.max_connections)
    exception_handler = accept_error_handler(throttle)

    # Idle connections of this server, oldest first: never sent a request / between requests.
    fresh: dict[H11Protocol, None] = {}
    kept_alive: dict[H11Protocol, None] = {}
    lingering: set[asyncio.Transport] = set()
    max_lingering = max(16, limits.max_connections // 4)

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.loop.get_exception_handler() is not exception_handler:
                self.loop.set_exception_handler(exception_handler)
            self._header_timer: asyncio.TimerHandle | None = None
            self._turned_away = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections and not self._evict_idle():
                self._turn_away(transport)
                return
            super().connection_made(transport)
            fresh[self] = None
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            self._not_idle()
            if self._turned_away:
                lingering.discard(self.transport)
                return
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._turned_away:
                return  # the request of a connection answered 503 already: discarded
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request's headers are in
                self._cancel_header_timer()
                self._not_idle()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                kept_alive[self] = None
                self._arm_header_timer()

        # ---- the cap ----
        def _evict_idle(self) -> bool:
            for idle in (fresh, kept_alive):
                while idle:
                    victim = next(iter(idle))
                    del idle[victim]
                    if victim.conn.their_state is h11.IDLE and not victim.transport.is_closing():
                        throttle.warning("evicted", "closed idle connections to make room (--max-connections %d)",
                                         limits.max_connections)
                        victim.transport.close()
                        victim.connections.discard(victim)  # its room is free now, not at connection_lost
                        return True
            return False

        def _turn_away(self, transport: asyncio.Transport) -> None:
            self._turned_away = True
            self.transport = transport
            throttle.warning("connections", "turned connections away: all %d are busy (--max-connections)",
                             limits.max_connections)
            transport.write(over_capacity)
            if transport.can_write_eof() and len(lingering) < max_lingering:
                transport.write_eof()
                lingering.add(transport)
                self.loop.call_later(LINGER_S, transport.close)
            else:
                transport.close()

        def _not_idle(self) -> None:
            fresh.pop(self, None)
            kept_alive.pop(self, None)

        # ---- the header timeout ----
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
                throttle.warning("header_timeout", "closed connections that sent no complete request headers "
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
