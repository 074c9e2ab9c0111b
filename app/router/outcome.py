"""How each forwarded request ended, as the proxy tells its observers: one
`Outcome` a request, given to one `RequestObserver` (the gateway fans it out
to its list: app/gateway/observers.py). The router declares what it tells;
the metrics that read it are the gateway's, never imported here.

A new per-request figure is a field here, filled where the router knows it
(proxy.py, `_ended`), and read by the observer that counts it: no
observer's signature changes (docs/design/metrics.md).
"""

from __future__ import annotations

from typing import Protocol


class Outcome:
    """`status` is what the client got, or: 499 the client left first; 502
    the engine broke off a stream already answered 200; 504 a stream stalled
    or ran past its deadline after its 200. `seconds`: from arrival to the
    end of the answer. `first_byte`: a stream's seconds from arrival to the
    engine's first body byte (None: not a stream, or none came). `prompt`
    and `completion`: the tokens its answer reported (estimated for a stream
    cut short; a llama.cpp stream's prompt comes later, through
    `prompt_counted`). `gateway`: the seconds the gateway itself added
    before the client's first byte: arrival to the answer's start, less the
    time its engines took (None: no engine answered, or the request waited
    for a replica to start or spilled, which is not the gateway's cost)."""

    __slots__ = ("completion", "first_byte", "gateway", "model", "prompt", "seconds", "status")

    # A plain class, not a dataclass: one is made a request, and a compiled
    # dataclass's `__init__` is still Python (call.py, `Call`).
    def __init__(self, model: str, status: int, seconds: float,
                 first_byte: float | None = None, prompt: int = 0, completion: int = 0,
                 gateway: float | None = None) -> None:
        self.model = model
        self.status = status
        self.seconds = seconds
        self.first_byte = first_byte
        self.prompt = prompt
        self.completion = completion
        self.gateway = gateway

    def __repr__(self) -> str:
        return (f"Outcome({self.model!r}, {self.status}, {self.seconds}, "
                f"first_byte={self.first_byte}, prompt={self.prompt}, "
                f"completion={self.completion}, gateway={self.gateway})")


class RequestObserver(Protocol):
    """Told how each forwarded request ended. Metrics implement it."""

    def observe(self, outcome: Outcome) -> None: ...

    def prompt_counted(self, model: str, tokens: int) -> None:
        """A stream's prompt tokens, counted by its engine after it ended."""

    def continued(self, model: str, outcome: str) -> None:
        """A stream was continued on another replica: how that ended (relay.py)."""
