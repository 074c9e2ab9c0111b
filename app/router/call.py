"""One `/v1` request on its way to a replica: the `Call`.

The proxy builds it once at the edge (proxy.py), after the key, the model
and the admission are settled, and every stage after reads it: the spill
and the hold (spill.py, hold.py), the attempts and the answer (relay.py),
the stream's chunk chain (relay_stream.py). A stage that learns something
the next one needs writes it here (`model` once spilled, `started` once a
held stream's headers are out), never in an out-parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from app.router.access import Exchange
from app.router.direct_body import DirectBody
from app.router.own_answers import Send
from app.router.published import Endpoint, KeyGrant
from app.router.timeouts import Watch

if TYPE_CHECKING:
    from app.router.usage.limits import Ticket
    from app.router.usage.meter import Meter

# What one attempt sends to its replica when the body is not JSON to POST as
# it is (passthrough.py): (method, body, content type).
Encoder = Callable[[Endpoint], tuple[bytes, bytes, bytes]]


class Overflow(Protocol):
    """A request's way to its model's overflow (spill.py, `Spill`)."""

    async def route(self, call: Call) -> str:
        """The model to send `call` to: its own, or its overflow."""
        ...


class Call:
    """What every stage of one request's sending reads.

    `url_tail`: the path and query string to ask the engine for. `body`'s
    model is the catalog name, which our engines serve; an external model's
    endpoint names the provider's model instead (encoded for that attempt
    only). `meter` notes the usage the answer reports (None: not metered);
    `ex` is told the replica and a stream's first byte, and gives the
    request id and trace context sent to the engine. `pin`: only that
    replica may take it; `encode`: the request each attempt sends; `raw`:
    the client's bytes, when `body` is exactly what they say (sent as they
    are). `spill`: the model's overflow may take the request instead
    (spill.py), on the key's `grant` and `ticket`.

    A plain class, not a dataclass: compiled (docs/design/hot-path.md, "The
    router compiled"), a dataclass's `__init__` is still the Python one the
    dataclasses module writes, a step of every request in the interpreter.
    """

    __slots__ = ("affinity", "body", "direct", "encode", "ex", "grant", "meter", "model", "pin",
                 "raw", "send", "sent", "spill", "started", "stream", "ticket", "url_tail",
                 "watch")

    def __init__(self, ex: Exchange, watch: Watch, send: Send, model: str, url_tail: str,
                 body: dict[str, Any], stream: bool) -> None:
        self.ex = ex
        self.watch = watch
        self.send = send
        self.model = model
        self.url_tail = url_tail
        self.body = body
        self.stream = stream
        # What the edge sets once the key is admitted (proxy.py):
        self.meter: Meter | None = None
        # the key's grant and its admission (the ticket holds its place in
        # the key's concurrency; `meter` is the ticket's, when metered);
        self.grant: KeyGrant | None = None
        self.ticket: Ticket | None = None
        self.affinity: str | None = None
        self.pin: str | None = None
        self.encode: Encoder | None = None
        self.raw: bytes | None = None
        self.spill: Overflow | None = None
        # The response began while the request was held (hold.py): its
        # headers are out, so only the body follows, and an error is its
        # last event.
        self.started = False
        # The server's direct writer of the response body, where it offers
        # one and `send` is its own (direct_body.py): a stream is then piped.
        self.direct: DirectBody | None = None
        # When the current attempt's request went out (`time.perf_counter()`):
        # the start of the engine's time (access.py, `Exchange.upstream_wait`).
        self.sent = 0.0
