"""What placement answers (placer.py): a `Fit` (the node and GPUs one more
replica takes) or a `NoFit`, the verdict as data in the manner of Nomad's
AllocMetric: each node evaluated was either FILTERED by a named constraint
(`Constraint`: cordoned, pool, node selector, engine build, agent version,
sick GPU, ...) or EXHAUSTED on a named dimension (`Dimension`: GPUs, GPU
memory, quota). Callers read the enums; text is rendered only at the edges
(the admin API, the router's 503, logs), and said shortly however large
the fleet (docs/design/placement.md)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class Fit:
    node: str
    gpus: list[int]


class Constraint(enum.Enum):
    """Why a node cannot take the replica whatever it holds: it is filtered."""

    AGENT_VERSION = "agent_version"  # outside the agent window (agentversion.py)
    DRAINING = "draining"
    CORDONED = "cordoned"
    POOL = "pool"
    NODE_SELECTOR = "node_selector"
    ENGINE = "engine"  # the engine is not on the node
    ENGINE_BUILD = "engine_build"  # no vLLM build for this profile (fleet.no_vllm_build)
    CPU_NODE = "cpu_node"  # llama.cpp replicas go to CPU nodes only
    SICK_GPU = "sick_gpu"  # enough GPUs free, were the sick ones not out (gpuhealth.py)


class Dimension(enum.Enum):
    """What a node (or the model's scope) has too little of: it is exhausted."""

    GPUS = "gpus"
    GPU_MEMORY = "gpu_memory"
    QUOTA = "quota"


@dataclass(frozen=True)
class Refusal:
    """Why one node cannot take the replica: the `reason` callers read, and
    its `detail` (numbers, names) said only when rendered. `profile` names
    the profile refused when the model has several (place_any)."""

    reason: Constraint | Dimension
    detail: str
    profile: str = ""

    @property
    def filtered(self) -> bool:
        return isinstance(self.reason, Constraint)

    def __str__(self) -> str:
        return f"{self.profile}: {self.detail}" if self.profile else self.detail


# Nodes named for one reason before it is said as a count and a few of them;
# also the most node names the structured form lists per reason.
_NAMED = 3
_SHOWN = 5


@dataclass(frozen=True)
class Group:
    """The nodes refused for one reason (of one profile): how many, and the
    first few by name (`_SHOWN` at most, so that a 10,000-node fleet's
    verdict stays a few lines), with the first node's detail."""

    reason: Constraint | Dimension
    profile: str
    count: int
    nodes: tuple[str, ...]
    detail: str

    def as_dict(self) -> dict[str, Any]:
        key = "constraint" if isinstance(self.reason, Constraint) else "dimension"
        out: dict[str, Any] = {key: self.reason.value, "count": self.count,
                               "nodes": list(self.nodes), "detail": self.detail}
        if self.profile:
            out["profile"] = self.profile
        return out


@dataclass(frozen=True)
class NoFit:
    """Why no node can take the replica: each node's refusals, one per
    profile tried (read-only, and shared by the models a pass refuses for
    the same reasons)."""

    refusals: Mapping[str, tuple[Refusal, ...]]

    @staticmethod
    def of(refusals: Mapping[str, Refusal]) -> NoFit:
        """The verdict over one profile: one refusal per node."""
        return NoFit({node: (why,) for node, why in refusals.items()})

    @property
    def evaluated(self) -> int:
        """Nodes evaluated (each refused)."""
        return len(self.refusals)

    @cached_property
    def groups(self) -> tuple[Group, ...]:
        """The refusals by (profile, reason), filters first, each reason's
        nodes counted and a few named."""
        by: dict[tuple[str, Constraint | Dimension], list[str]] = {}
        first: dict[tuple[str, Constraint | Dimension], str] = {}
        for node in sorted(self.refusals):
            for why in self.refusals[node]:
                key = (why.profile, why.reason)
                names = by.get(key)
                if names is None:
                    by[key] = [node]
                    first[key] = why.detail
                else:
                    names.append(node)
        return tuple(Group(reason, profile, len(names), tuple(names[:_SHOWN]),
                           first[(profile, reason)])
                     for (profile, reason), names in sorted(
                         by.items(), key=lambda kv: (not isinstance(kv[0][1], Constraint),
                                                     kv[0][0], kv[0][1].value)))

    def counts(self) -> tuple[dict[Constraint, int], dict[Dimension, int]]:
        """Nodes filtered per constraint and exhausted per dimension (over
        every profile tried: a node refused by two is counted by each)."""
        filtered: dict[Constraint, int] = {}
        exhausted: dict[Dimension, int] = {}
        for g in self.groups:
            if isinstance(g.reason, Constraint):
                filtered[g.reason] = filtered.get(g.reason, 0) + g.count
            else:
                exhausted[g.reason] = exhausted.get(g.reason, 0) + g.count
        return filtered, exhausted

    def texts(self) -> dict[str, str]:
        """Each node's refusals as text (tests, a single node's view): not
        for a whole fleet's answer, which `str()` says shortly."""
        return {node: "; ".join(map(str, whys)) for node, whys in self.refusals.items()}

    def named(self) -> dict[str, str]:
        """The refusals, as text, of the nodes the groups name: a few per
        reason, however large the fleet (a model's health)."""
        names = sorted({node for g in self.groups for node in g.nodes})
        return {node: "; ".join(map(str, self.refusals[node])) for node in names}

    def as_dict(self) -> dict[str, Any]:
        """The verdict as JSON (the admin API): counts, the bounded groups,
        and the text a client is told."""
        filtered, exhausted = self.counts()
        return {"nodes_evaluated": self.evaluated,
                "nodes_filtered": {c.value: n for c, n in filtered.items()},
                "nodes_exhausted": {d.value: n for d, n in exhausted.items()},
                "reasons": [g.as_dict() for g in self.groups],
                "text": str(self)}

    @cached_property
    def _said(self) -> str:
        # Each reason once, with its nodes: on a full fleet of 10,000 nodes
        # one reason per node was half a megabyte per waiting model, in its
        # status, the logs and the router's 503.
        by_reason: dict[str, list[str]] = {}
        for node in sorted(self.refusals):
            by_reason.setdefault("; ".join(map(str, self.refusals[node])), []).append(node)
        parts = []
        for why, names in by_reason.items():
            if len(names) <= _NAMED:
                parts.append(f"{', '.join(names)}: {why}")
            else:
                parts.append(f"{len(names):,} nodes: {why} ({', '.join(names[:_SHOWN])} "
                             f"and {len(names) - _SHOWN:,} more)")
        return "; ".join(parts)

    def __str__(self) -> str:
        return self._said if self.refusals else "no nodes"
