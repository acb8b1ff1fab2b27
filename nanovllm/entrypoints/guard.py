"""Request checks that run before the app reads a byte of the body: Host, API key, body size.

A pure ASGI middleware, so that an unauthenticated or oversized request costs no parsing: the
API key is checked on the headers alone (401 before the body is read; FastAPI would parse the
body first), the Host header against the server's policy (DNS rebinding: a web page whose
name now resolves to 127.0.0.1 reaches a key-less local server, but its requests still carry
its own name), and the body is read here, counting bytes as they arrive, refused with 413 once
over the limit (or at once from Content-Length) and with 408 if it takes longer than the body
timeout. The body that passes is handed to the app as one message; later `receive()` calls go
to the server (disconnect detection keeps working).

Every refusal is OpenAI's error body; refusals are logged through `LogThrottle`, at most once
per interval per kind, so a flood cannot flood the log.

`CORSGuard`, outside everything else, answers browsers' CORS preflights (before the API key is
asked for: a browser sends none on a preflight) and adds the CORS headers to every response,
refusals too, so that a page can read them. `InternalErrorGuard`, just inside it, answers a
handler's unexpected exception with OpenAI's 500 body, so that a 500 carries them as well.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from nanovllm.entrypoints.limits import ServerLimits
from nanovllm.entrypoints.protocol import error_body

logger = logging.getLogger("nanovllm.server")


class LogThrottle:
    """Log a kind of event at most once per `interval` seconds, with how many were not logged."""

    def __init__(self, log: logging.Logger, interval: float) -> None:
        self.log = log
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        suffix = f" (and {skipped} more in the last {now - last:.0f} s)" if skipped and last is not None else ""
        self.log.warning(message + suffix, *args)


def json_error_bytes(message: str, type: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps(error_body(message, type, param, code)).encode()


async def send_error(send: Callable, status: int, message: str, type: str, code: str | None,
                     headers: dict[str, str] | None = None) -> None:
    body = json_error_bytes(message, type, code)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class RequestGuard:
    """Host check, API key check (/v1/*), body size and time limits; see the module docstring."""

    def __init__(self, app: Any, limits: ServerLimits, api_key: str | None) -> None:
        self.app = app
        self.limits = limits
        self.api_key = api_key.encode() if api_key else None
        self.throttle = LogThrottle(logger, limits.log_interval)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        client = (scope.get("client") or ("?",))[0]
        if not self.limits.host_allowed(headers.get("host"), self.api_key is not None):
            self.throttle.warning("host", "refused a request for Host %r from %s (see --allowed-hosts)",
                                  headers.get("host"), client)
            await send_error(send, 400, "this server does not serve the host named in the Host header "
                             "(see --allowed-hosts)", "invalid_request_error", "invalid_host")
            return
        if self.api_key is not None and scope.get("path", "").startswith("/v1/") and not self._authorized(headers):
            self.throttle.warning("auth", "refused a request with a wrong or missing API key from %s", client)
            await send_error(send, 401, "invalid API key: send 'Authorization: Bearer <key>'",
                             "authentication_error", "invalid_api_key")
            return
        limit = self.limits.max_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._too_large(send, client)
            return
        try:
            async with asyncio.timeout(self.limits.timeout_body):
                message = await self._read_body(receive, limit)
        except _BodyTooLarge:
            await self._too_large(send, client)
            return
        except TimeoutError:
            self.throttle.warning("body_timeout", "refused a request whose body took over %.0f s, from %s",
                                  self.limits.timeout_body, client)
            await send_error(send, 408, f"the request body did not arrive within {self.limits.timeout_body:g} s",
                             "invalid_request_error", "request_timeout", {"connection": "close"})
            return
        if message["type"] == "http.disconnect":
            return  # the client left before its request was complete: nothing to answer
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return message
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key)

    @staticmethod
    async def _read_body(receive: Callable, limit: int) -> dict:
        """The whole body as one http.request message (or the http.disconnect that cut it short)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _too_large(self, send: Callable, client: str) -> None:
        self.throttle.warning("body_size", "refused a request body over %d bytes from %s",
                              self.limits.max_body_bytes, client)
        await send_error(send, 413, f"the request body is larger than {self.limits.max_body_bytes} bytes",
                         "invalid_request_error", "request_too_large", {"connection": "close"})


class InternalErrorGuard:
    """An exception that escapes the app (a bug) is logged and answered with OpenAI's 500 body
    here, inside `CORSGuard`, so that the answer carries the CORS headers of every other one.
    Where the response has already started (a stream), the exception goes on to the server,
    which closes the connection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_and_note(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:
            logger.exception("internal error while serving %s", scope.get("path", ""))
            if started:
                raise
            await send_error(send, 500, f"internal server error: {type(exc).__name__}", "server_error", None)


# What a refused preflight names (Starlette's word for it) -> the flag that allows it.
_CORS_FLAGS = {"origin": "--allowed-origins", "method": "--allowed-methods", "headers": "--allowed-headers"}


class CORSGuard(CORSMiddleware):
    """Starlette's CORS middleware with the policy of `limits` (vLLM's flags); a preflight it
    refuses gets OpenAI's error body (400, `code: "cors_refused"`) instead of plain text."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        super().__init__(app, allow_origins=limits.allowed_origins, allow_methods=limits.allowed_methods,
                         allow_headers=limits.allowed_headers, allow_credentials=limits.allow_credentials)

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ").split(", ")
        what = ", ".join(f"{r} (see {_CORS_FLAGS[r]})" if r in _CORS_FLAGS else r for r in refused)
        headers = {k: v for k, v in response.headers.items() if k.startswith("access-control-") or k == "vary"}
        return JSONResponse(error_body(f"this server's CORS policy does not allow the request's {what}",
                                       "invalid_request_error", code="cors_refused"),
                            status_code=response.status_code, headers=headers)
