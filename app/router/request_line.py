"""What a request to an engine or a provider is made of, checked before
anything is sent: the origin its base URL points to, its target and its
header lines, none holding a control character (app/router/upstream.py
sends it)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple
from urllib.parse import urlsplit

# Bytes that may not appear in a request target or a header value (CR, LF and
# the other controls): they would let a value end the line it is on.
_UNSAFE = re.compile(rb"[\x00-\x1f\x7f]")
UNSAFE_TARGET = re.compile(rb"[\x00-\x20\x7f]")


def header_lines(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """Request header lines, each checked: Unsendable names the first that
    holds a control character."""
    for name, value in headers:
        if _UNSAFE.search(value) or _UNSAFE.search(name):
            raise Unsendable(f"unsafe value in request header {name!r}")
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)


@lru_cache(maxsize=1024)
def header_block(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """Request header lines checked and joined once (a route's own, which
    every request to it repeats); `post(preset=...)` sends them as they are.
    A route's own header is ours, not a client's: UpstreamError."""
    try:
        return header_lines(headers)
    except Unsendable as exc:
        raise UpstreamError(str(exc)) from None


class UpstreamError(Exception):
    """The connection failed, broke, or carried something that is not HTTP."""


class Unsendable(UpstreamError):
    """The request itself cannot be sent as asked (a control character in its
    target or a header value): nothing was sent, and no server failed. Its
    caller says whose input it was; the router's is the client's (relay.py)."""


def unsafe_target(target: str) -> bool:
    """Whether `target` (a path and query string) can go on no request line."""
    try:
        return UNSAFE_TARGET.search(target.encode("latin-1")) is not None
    except UnicodeEncodeError:
        return True


class Origin(NamedTuple):
    """Where a base URL points: what a connection is opened to, the Host
    header, and the path every request target starts with."""

    scheme: str
    host: str
    port: int
    host_header: bytes
    prefix: bytes


@lru_cache(maxsize=4096)
def origin(base_url: str) -> Origin:
    """The origin of an engine's or provider's base URL (http or https)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"not an http(s) URL: {base_url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    default = port == (443 if parts.scheme == "https" else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    header = shown if default else f"{shown}:{port}"
    return Origin(parts.scheme, host, port, header.encode("idna"),
                  parts.path.rstrip("/").encode())
