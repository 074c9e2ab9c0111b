"""The proxy's one `RequestObserver` (app/router/outcome.py): each request's
end told to every observer of a list, in its order (docs/design/metrics.md).

The gateway's list (app/gateway/assembly.py): when each model was last
asked for (router_usage.py, `LastUse`), the last minutes' series
(request_series.py) and the metrics (request_metrics.py). A new per-request
figure is a member of one of them, or a new member of the list: no observer
forwards to another. On the request path: one call per member.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.router.outcome import Outcome, RequestObserver


class Observers:
    """A `RequestObserver` that calls each of `members` in turn."""

    __slots__ = ("_members",)

    def __init__(self, members: Iterable[RequestObserver]) -> None:
        self._members = tuple(members)

    def observe(self, outcome: Outcome) -> None:
        for member in self._members:
            member.observe(outcome)

    def prompt_counted(self, model: str, tokens: int) -> None:
        for member in self._members:
            member.prompt_counted(model, tokens)

    def continued(self, model: str, outcome: str) -> None:
        for member in self._members:
            member.continued(model, outcome)
