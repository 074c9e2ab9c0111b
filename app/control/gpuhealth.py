"""Sick GPUs as the gateways see them (docs/design/gpu-health.md).
Pure functions of the mirrored state; the clear's write is a
node conf edit the admin API applies.

An agent reports a GPU "unhealthy" with its latest fault and keeps doing
so (app/agent/gpuhealth.py). The GPU is sick while that reason is not the
one an admin cleared for it (`NodeConf.gpu_cleared`): placement keeps it
out, and the replica on it is moved like one on a drained node
(app/control/plan/). A new fault is a new reason, so a cleared GPU that
fails again is sick again; comparing reasons, not times, needs no clock
shared by agents and gateways.
"""

from __future__ import annotations

from collections.abc import Mapping

from app.control import state as s


def is_sick(gpu: s.GpuInfo, cleared: Mapping[int, str]) -> bool:
    """Whether `gpu` is out: reported unhealthy, for a reason an admin has
    not cleared (`cleared`: the node conf's GPU index -> reason cleared)."""
    return gpu.health == "unhealthy" and cleared.get(gpu.index) != gpu.health_reason


def sick_gpus(node: s.NodeInfo, conf: s.NodeConf | None) -> dict[int, str]:
    """GPU index -> why it is out, for the node's GPUs that are."""
    cleared = conf.gpu_cleared if conf is not None else {}
    return {g.index: g.health_reason for g in node.gpus if is_sick(g, cleared)}


def sick_by_node(nodes: Mapping[str, s.NodeInfo], confs: Mapping[str, s.NodeConf]
                 ) -> dict[str, dict[int, str]]:
    """Node -> its sick GPUs, for the nodes that have some."""
    out = {}
    for name, node in nodes.items():
        # Most nodes have no GPU reported unhealthy: a look at each, no
        # dict built (10,000 nodes: ~35 ms of a pass went to building them).
        for g in node.gpus:
            if g.health == "unhealthy":
                break
        else:
            continue
        sick = sick_gpus(node, confs.get(name))
        if sick:
            out[name] = sick
    return out


def on_sick_gpu(rep: s.Replica, sick: Mapping[str, Mapping[int, str]]) -> str:
    """Why `rep` must move (a GPU of its is sick), or ""."""
    mine = sick.get(rep.node, {})
    for index in rep.gpus:
        if index in mine:
            return f"GPU {index} of {rep.node} is unhealthy: {mine[index]}"
    return ""


class NoSuchGpu(LookupError):
    """The node does not report that GPU (its message says so)."""


def cleared(conf: s.NodeConf, node: s.NodeInfo | None, name: str, index: int) -> s.NodeConf:
    """`conf` with GPU `index`'s present fault cleared: the GPU is placed
    on again until its agent reports another. A healthy GPU's entry is
    dropped (nothing to clear). Raises NoSuchGpu when the node is not
    heard from (its GPUs' health is unknown) or has no such GPU."""
    if node is None:
        raise NoSuchGpu(f"node {name!r} is not heard from: its GPUs' health is unknown")
    gpu = next((g for g in node.gpus if g.index == index), None)
    if gpu is None:
        raise NoSuchGpu(f"node {name!r} reports no GPU {index}")
    kept = {i: r for i, r in conf.gpu_cleared.items()
            if i != index and any(g.index == i for g in node.gpus)}
    if gpu.health == "unhealthy":
        kept[index] = gpu.health_reason
    return conf.model_copy(update={"gpu_cleared": kept})
