"""The proxy's one `RequestObserver` (app/router/proxy.py): each request's
end told to every observer of a list, in its order (docs/design/metrics.md).

The gateway's list (app/gateway/assembly.py): when each model was last
asked for (router_usage.py, `LastUse`), the last minutes' series
(request_series.py) and the metrics (request_metrics.py). A new per-request
figure is a member of one of them, or a new member of the list: no observer
forwards to another. On the request path: one call per member.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.router.proxy import RequestObserver


class Observers:
    """A `RequestObserver` that calls each of `members` in turn."""

    __slots__ = ("_members",)

    def __init__(self, members: Iterable[RequestObserver]) -> None:
        self._members = tuple(members)

    def observe(self, model: str, status: int, seconds: float,
                first_byte: float | None = None, prompt: int = 0,
                completion: int = 0) -> None:
        for member in self._members:
            member.observe(model, status, seconds, first_byte, prompt, completion)

    def prompt_counted(self, model: str, tokens: int) -> None:
        for member in self._members:
            member.prompt_counted(model, tokens)

    def continued(self, model: str, outcome: str) -> None:
        for member in self._members:
            member.continued(model, outcome)
