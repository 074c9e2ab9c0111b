"""The headers of a request to a replica (built and checked once per
replica key) and those passed on to the client with its answer."""

from __future__ import annotations

from functools import lru_cache

from app.router.access import Exchange
from app.router.published import Endpoint
from app.router.request_line import header_block
from app.router.spill import served_by
from app.router.upstream import Response


@lru_cache(maxsize=1024)
def route_headers(key: str, json_body: bool = True) -> bytes:
    """A replica's own request headers, built and checked once (upstream.py);
    with `json_body`, its Content-Type too (a form's, which carries a
    boundary of its own, goes with the request's headers)."""
    return header_block((
        (b"Authorization", b"Bearer " + key.encode()),
        *(((b"Content-Type", b"application/json"),) if json_body else ()),
        # Never the client's: a stream compressed as it asked (br, say)
        # could not be read for its usage, nor end with an error event.
        # Identity to a client that accepted more is valid HTTP
        # (docs/design/security.md).
        (b"Accept-Encoding", b"identity")))


def passed_on(upstream: Response, ep: Endpoint, ex: Exchange,
               decoded: bool = False) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-llmgw-replica", ep.replica_id.encode()), ex.header, *served_by(ex)]
    encoding = upstream.headers.get("content-encoding")
    if encoding is not None and not decoded:  # bytes pass as the engine encoded them
        headers.append((b"content-encoding", encoding.encode()))
    return headers
