"""What route modules are handed instead of the whole gateway: interfaces
declared where they are used, wired in one place (app/gateway/main.py create_app).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.control.mirror import Mirror
    from app.router.choice import EngineLoad


class MirrorState(Protocol):
    """A reader of the store's mirror, which exists once the gateway has
    started and answers only once loaded (`ready`; DESIGN invariant 9).
    The gateway (app/gateway/gateway.py) is one."""

    @property
    def ready(self) -> bool: ...

    @property
    def mirror(self) -> Mirror: ...


class RoutesRead(Protocol):
    """This gateway's route table as its router holds it, read only (for the
    admin API's views). app/router/table.py's RouteTable is one."""

    def resolve(self, requested: str) -> str | None: ...

    def unavailable(self, model: str) -> str | None: ...

    def endpoints(self, model: str) -> Sequence[object]: ...

    def explain(self, model: str) -> list[dict[str, object]]: ...

    def overflow(self, model: str) -> str | None: ...

    def inflight(self, replica_id: str) -> int: ...

    def fresh_loads(self) -> Mapping[str, EngineLoad]: ...
