"""What placement answers (app/control/placement.py): a `Fit` (the node and
GPUs one more replica takes) or a `NoFit` (why each node cannot), said
shortly however large the fleet."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Fit:
    node: str
    gpus: list[int]


# Nodes named for one reason before it is said as a count and a few of them.
_NAMED = 3
_SHOWN = 5


@dataclass(frozen=True)
class NoFit:
    """Why no node can take the replica: each node's reason (read-only, and
    shared by the models a pass refuses for the same reasons)."""

    reasons: dict[str, str]

    @cached_property
    def _said(self) -> str:
        # Each reason once, with its nodes: on a full fleet of 10,000 nodes
        # one reason per node was half a megabyte per waiting model, in its
        # status, the logs and the router's 503.
        by_reason: dict[str, list[str]] = {}
        for node in sorted(self.reasons):
            by_reason.setdefault(self.reasons[node], []).append(node)
        parts = []
        for why, names in by_reason.items():
            if len(names) <= _NAMED:
                parts.append(f"{', '.join(names)}: {why}")
            else:
                parts.append(f"{len(names):,} nodes: {why} ({', '.join(names[:_SHOWN])} "
                             f"and {len(names) - _SHOWN:,} more)")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self._said if self.reasons else "no nodes"
