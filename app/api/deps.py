"""What route modules are handed instead of the whole gateway: interfaces
declared where they are used, wired in one place (app/main.py create_app).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.control.mirror import Mirror


class MirrorState(Protocol):
    """A reader of the store's mirror, which exists once the gateway has
    started and answers only once loaded (`ready`; DESIGN invariant 9).
    The gateway (app/gateway.py) is one."""

    @property
    def ready(self) -> bool: ...

    @property
    def mirror(self) -> Mirror: ...
