"""`HealthTracker`: a store's reachability, told by the outcome of its calls.

The elector calls the store every `LLMGW_ELECTION_INTERVAL`, so a gateway
notices a lost store within one interval without a probe of its own. A
change is logged once, when it happens (one line when the store becomes
unreachable, one when it is back), not once per failed call: a gateway cut
off for an hour would otherwise log thousands of lines saying the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from app.store.base import StoreHealth

logger = logging.getLogger(__name__)


class HealthTracker:
    def __init__(self, name: str, clock: Callable[[], float] = time.time) -> None:
        self._name = name
        self._clock = clock
        self._health = StoreHealth()

    def current(self) -> StoreHealth:
        return self._health

    def succeeded(self) -> None:
        was = self._health
        if was.state == "reachable":
            return
        self._health = StoreHealth("reachable")
        if was.state == "unreachable" and was.since is not None:
            logger.warning("%s is reachable again after %.1f s unreachable",
                           self._name, self._clock() - was.since)

    def failed(self, reason: str) -> None:
        was = self._health
        if was.state == "unreachable":
            # The latest reason is the useful one (a name that now resolves
            # but a member that refuses); the start of the outage stays.
            self._health = StoreHealth("unreachable", reason, was.since)
            return
        self._health = StoreHealth("unreachable", reason, self._clock())
        logger.warning("%s is unreachable: %s; writes answer 503 until it is back",
                       self._name, reason)
