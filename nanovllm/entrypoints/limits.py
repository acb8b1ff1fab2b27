"""The server's limits and security policy: one frozen dataclass, its command-line flags, and
the process's file-descriptor limit.

docs/server.md ("Limits and security") lists every limit with its default and flag. The defaults are meant to keep the
server reachable under abuse (floods of idle connections, huge bodies, huge fan-out requests)
without getting in the way of ordinary OpenAI clients.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import resource
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("nanovllm.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# File descriptors kept free of connections: the model files, the engine's sockets and pipes,
# logs, and the sockets being accepted and turned away.
FD_RESERVE = 256
_HTTP_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a method or header name (RFC 9110 token)
# scheme://host[:port] as browsers send an origin: lower case, a port of 1-65535 digits' worth.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(?:[^\x00-\x20\x7f/?#@:\[\]]+|\[[0-9a-f:.]+\])(?::(\d{1,5}))?")


def cors_list(kind: str, values: Any) -> tuple[str, ...]:
    """`values` checked as the CORS `kind` ("origins", "methods" or "headers"): a list of
    strings, '*' meaning any; methods upper-cased, as browsers send them. ValueError says what is
    wrong."""
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"the allowed {kind} must be a list of strings (JSON on the command line, such as "
                         f"'[\"*\"]'), got {values!r}")
    for value in values:
        if value == "*" or (kind == "origins" and value == "null"):  # "null": a sandboxed page or file: URL
            continue
        origin = _ORIGIN.fullmatch(value) if kind == "origins" else None
        if kind == "origins" and (origin is None or (origin[1] and not 0 < int(origin[1]) < 65536)):
            hint = ", in lower case as browsers send it" if value != value.lower() else ""
            raise ValueError(f"{value!r} is not an origin: scheme://host[:port] with no path{hint}, such as "
                             f"'https://app.example' (or '*' for any)")
        if kind != "origins" and not _HTTP_TOKEN.fullmatch(value):
            raise ValueError(f"{value!r} is not an HTTP {kind[:-1]} name")
    return tuple(v.upper() for v in values) if kind == "methods" else tuple(values)


@dataclass(frozen=True)
class ServerLimits:
    # Connections (uvicorn's h11 protocol, nanovllm/entrypoints/http_protocol.py)
    max_connections: int = 2048  # open at once; more are answered 503 and closed at accept
    timeout_header: float = 10.0  # seconds from connect (or the end of a response) to a request's headers
    timeout_keep_alive: float = 5.0  # seconds an idle keep-alive connection is kept (uvicorn's)
    # incomplete request line + headers buffered (uvicorn's h11_max_incomplete_event_size)
    max_header_bytes: int = 16 * 1024
    backlog: int = 2048  # listen backlog (uvicorn's)
    # Requests (nanovllm/entrypoints/guard.py)
    max_body_bytes: int = 32 * 1024 * 1024  # request body; over it -> 413
    timeout_body: float = 30.0  # seconds to receive the whole body; over it -> 408
    allowed_hosts: tuple[str, ...] | None = None  # Host header names; None: loopback only without an API key
    # Per request (protocol.py `check_limits`)
    max_n: int = 128  # samples per prompt
    max_prompts: int = 64  # prompts in one /v1/completions request
    # Chat (nanovllm/chat.py)
    parse_special_tokens_in_chat: bool = False  # True: special-token text in messages becomes control tokens
    chat_template: str | None = None  # the template's text (--chat-template), in place of the model's
    # A request's own chat_template (vLLM's field) is rendered only when this is set: a template is
    # code that runs in the server (in Jinja's sandbox).
    trust_request_chat_template: bool = False
    # CORS (browsers; vLLM's flags): what a page of another origin may send and read. No origin by
    # default (vLLM's default is any): with '*', any page a browser opens could use a key-less
    # server on loopback and read its answers.
    allowed_origins: tuple[str, ...] = ()  # '*': any
    allow_credentials: bool = False  # cookies and HTTP authentication sent along
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)  # request headers beyond the CORS-safelisted ones
    # Rejections are logged at most once per this many seconds per kind, with a count.
    log_interval: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "backlog", "max_body_bytes", "max_n", "max_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServerLimits.{name} must be an integer >= 1 (got {value!r})")
        for name in ("timeout_header", "timeout_keep_alive", "timeout_body", "log_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"ServerLimits.{name} must be a number > 0 (got {value!r})")
        if self.allowed_hosts is not None:
            if isinstance(self.allowed_hosts, str) or not all(isinstance(h, str) for h in self.allowed_hosts):
                raise ValueError(f"ServerLimits.allowed_hosts must be a tuple of names (got {self.allowed_hosts!r})")
            # compared with the Host header's name: lower case, no brackets around IPv6
            object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower().strip("[]") for h in self.allowed_hosts))
        for kind in ("origins", "methods", "headers"):
            try:
                object.__setattr__(self, f"allowed_{kind}", cors_list(kind, getattr(self, f"allowed_{kind}")))
            except ValueError as exc:
                raise ValueError(f"ServerLimits.allowed_{kind}: {exc}") from None
        if not isinstance(self.allow_credentials, bool):
            raise ValueError(f"ServerLimits.allow_credentials must be a bool (got {self.allow_credentials!r})")

    def host_allowed(self, host: str | None, api_key_set: bool) -> bool:
        """Whether a request with this Host header is served. With --allowed-hosts, those names
        ('*' = any); without, any host when an API key is required, else loopback names only
        (a page on another site, DNS-rebound to 127.0.0.1, still says its own name)."""
        allowed = self.allowed_hosts
        if allowed is None:
            if api_key_set:
                return True
            allowed = LOOPBACK_HOSTS
        if "*" in allowed:
            return True
        name = _host_name(host)
        return name is not None and name in allowed


def _host_name(host: str | None) -> str | None:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '::1'; None if absent or malformed."""
    if not host:
        return None
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.rstrip(".") or None


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most 2**20); returns the soft limit.
    The common default soft limit, 1024, is far below what a server with many clients needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard if hard != resource.RLIM_INFINITY else 2**20, 2**20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def fit_to_fd_limit(limits: ServerLimits, fd_limit: int) -> ServerLimits:
    """`limits` with max_connections lowered to fit under the fd limit (with FD_RESERVE spare)."""
    from dataclasses import replace

    room = max(1, fd_limit - FD_RESERVE)
    if limits.max_connections > room:
        logger.warning("--max-connections %d lowered to %d: the open-file limit is %d",
                       limits.max_connections, room, fd_limit)
        return replace(limits, max_connections=room)
    return limits


def warn_open_host(bind_host: str, api_key: str | None, limits: ServerLimits) -> None:
    """Say at start-up what applies when the server listens beyond loopback with no API key:
    anyone who can reach it may use it, and only the Host names allowed are served."""
    if api_key or _host_name(bind_host) in LOOPBACK_HOSTS:
        return
    if limits.allowed_hosts is None:
        logger.warning("listening on %s with no API key: only Host headers %s are served; pass --allowed-hosts "
                       "with the names clients use (or '*'), and consider --api-key",
                       bind_host, ", ".join(LOOPBACK_HOSTS))
    else:
        logger.warning("listening on %s with no API key: anyone who can reach it can use it (Host: %s)",
                       bind_host, ", ".join(limits.allowed_hosts))


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    d = ServerLimits()
    g = parser.add_argument_group("limits and security (docs/server.md)")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections at once; more get 503 at accept (default: %(default)s)")
    g.add_argument("--timeout-header", type=float, default=d.timeout_header,
                   help="seconds a connection may take to send a request's headers (default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                   help="seconds an idle keep-alive connection is kept open (default: %(default)s)")
    g.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help="most bytes of an incomplete request line + headers buffered (default: %(default)s)")
    g.add_argument("--backlog", type=int, default=d.backlog, help="listen backlog (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body; larger -> 413 (default: %(default)s)")
    g.add_argument("--timeout-body", type=float, default=d.timeout_body,
                   help="seconds to receive a request body; slower -> 408 (default: %(default)s)")
    g.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names served ('*' = any; default: any with an API key, "
                        "else localhost,127.0.0.1,::1)")
    g.add_argument("--max-n", type=int, default=d.max_n, help="largest n per request (default: %(default)s)")
    g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts,
                   help="most prompts in one /v1/completions request (default: %(default)s)")
    g.add_argument("--parse-special-tokens-in-chat", action="store_true",
                   help="let special-token text in chat messages become control tokens (as vLLM and llama.cpp do)")
    g.add_argument("--chat-template", type=_chat_template_arg, default=None,
                   help="the chat template to use instead of the model's: a file, or the template itself")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own chat_template (vLLM's field; refused with a 400 otherwise)")
    c = parser.add_argument_group("CORS (vLLM's flags; docs/server.md)")
    c.add_argument("--allowed-origins", type=_json_cors_list("origins"), default=d.allowed_origins,
                   help='JSON list of the origins whose pages may call the server, e.g. \'["https://app.example"]\' '
                        '(default: none; \'["*"]\': any)')
    c.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=d.allow_credentials,
                   help="let those pages send cookies and HTTP authentication (default: no)")
    c.add_argument("--allowed-methods", type=_json_cors_list("methods"), default=d.allowed_methods,
                   help='JSON list of the HTTP methods they may use (default: \'["*"]\', any)')
    c.add_argument("--allowed-headers", type=_json_cors_list("headers"), default=d.allowed_headers,
                   help='JSON list of the request headers they may send (default: \'["*"]\', any)')


def _chat_template_arg(value: str) -> str:
    """argparse type: --chat-template's template text (chat.load_chat_template)."""
    from nanovllm.chat import load_chat_template

    try:
        return load_chat_template(value)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_cors_list(kind: str):
    """argparse type: a JSON list of CORS `kind` (vLLM takes these flags as JSON too)."""
    def parse(text: str) -> tuple[str, ...]:
        try:
            values = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not JSON; give a JSON list such as '[\"*\"]'") from None
        try:
            return cors_list(kind, values)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    hosts = None
    if args.allowed_hosts is not None:
        hosts = tuple(h for h in args.allowed_hosts.split(",") if h.strip())
    return ServerLimits(
        max_connections=args.max_connections, timeout_header=args.timeout_header,
        timeout_keep_alive=args.timeout_keep_alive, max_header_bytes=args.max_header_bytes, backlog=args.backlog,
        max_body_bytes=args.max_body_bytes, timeout_body=args.timeout_body, allowed_hosts=hosts,
        max_n=args.max_n, max_prompts=args.max_prompts_per_request,
        parse_special_tokens_in_chat=args.parse_special_tokens_in_chat,
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
        allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
    )
