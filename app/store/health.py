"""`HealthTracker`: a store's reachability, told by the outcome of its calls.

The elector renews its lease every fifth of `LLMGW_LEASE_TTL` (2 s at the
default), so a gateway notices a lost store within one renewal without a
probe of its own. A
change is logged once, when it happens (one line when the store becomes
unreachable, one when it is back), not once per failed call: a gateway cut
off for an hour would otherwise log thousands of lines saying the same.

Out of space (`nospace`, etcd's NOSPACE alarm) is a state of its own: etcd
still answers reads and lease renewals then, so only a write that succeeds
(`succeeded(write=True)`) or the store's word that the alarm is gone
(`space_back()`) ends it; a read does not.
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

    def succeeded(self, write: bool = False) -> None:
        was = self._health
        if was.state == "reachable" or (was.state == "nospace" and not write):
            return
        if was.state == "nospace":
            self.space_back()
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

    def full(self, reason: str) -> None:
        """A write was refused for lack of space (`StoreFull`)."""
        was = self._health
        if was.state == "nospace":
            self._health = StoreHealth("nospace", reason, was.since)
            return
        self._health = StoreHealth("nospace", reason, self._clock())
        logger.error("%s is out of space and refuses writes: %s; compact, defragment "
                     "(etcdctl defrag) and disarm the alarm (etcdctl alarm disarm): "
                     "docs/design/security-operations.md, \"A month of uptime\"", self._name,
                     reason)

    def space_back(self) -> None:
        was = self._health
        if was.state != "nospace":
            return
        self._health = StoreHealth("reachable")
        if was.since is not None:
            logger.warning("%s accepts writes again after %.1f s out of space",
                           self._name, self._clock() - was.since)
