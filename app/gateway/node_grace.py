"""Nodes whose key just went, still routed for a heartbeat or so.

A node's key (`nodes/{node}`) is bound to a lease its agent's heartbeats
keep alive, and a node without a key is "not heard from": its replicas are
out of the router. But a key can go with its agent alive: etcd back from an
outage past the TTL drops every lease at once, and each agent registers
again only at its next heartbeat. `NodeGrace` keeps such a node's replicas
routed for `grace` seconds after its key went (two heartbeats and a
little: half the node TTL and 2 s), so an etcd outage does not end in a
fleet-wide 503; a node whose
agent is really gone was already silent for the whole TTL before its key
went, so this adds `grace` to the time its replicas are tried (and a dead
engine's connection errors move requests elsewhere meanwhile).
docs/design/control-plane.md, "Node grace".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection


class NodeGrace:
    def __init__(self, grace: float, clock: Callable[[], float],
                 wake: Callable[[], None]) -> None:
        self._grace = grace
        self._clock = clock
        self._wake = wake  # asks for a publish: called once a grace ends
        self._present: frozenset[str] = frozenset()
        self._seen: Collection[str] | None = None  # what `_present` was taken from
        self._missing_since: dict[str, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def held(self, nodes: Collection[str]) -> frozenset[str]:
        """Of the nodes not in `nodes` (the keys there now), those still
        held: present at an earlier call and gone less than `grace` ago."""
        now = self._clock()
        if nodes is not self._seen:  # the mirror's view: a new one when a node changes
            for name in self._present.difference(nodes):
                self._missing_since.setdefault(name, now)
            for name in [n for n in self._missing_since if n in nodes]:
                del self._missing_since[name]
            self._present = frozenset(nodes)
            self._seen = nodes
        held = set()
        for name, since in list(self._missing_since.items()):
            if now - since < self._grace:
                held.add(name)
            else:
                del self._missing_since[name]
        if held:
            self._call_at(min(self._missing_since[n] for n in held) + self._grace - now)
        return frozenset(held)

    def _call_at(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with contextlib.suppress(RuntimeError):  # no running loop: the caller publishes
            self._timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._wake)
