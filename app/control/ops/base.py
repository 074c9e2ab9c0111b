"""What every operation writes through: the store and this gateway's
mirror of it. Both exist only once the gateway has started (app/gateway/assembly.py
opens them), so an operation is handed something that yields them when a
request runs, not the parts themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from app.control.mirror import Mirror
from app.store.base import Store

# Seconds a write waits for this gateway's mirror to see it, so a read right
# after a write on the same gateway reads what was written.
SETTLE = 2.0


class State(Protocol):
    """The started gateway (app/gateway/gateway.py) is one."""

    @property
    def store(self) -> Store: ...

    @property
    def mirror(self) -> Mirror: ...


@dataclass(frozen=True)
class Parts:
    """A store and its mirror, as a State (tests, tools)."""

    store: Store
    mirror: Mirror
