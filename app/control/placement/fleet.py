"""What the fleet holds, as placement sees it: pure functions of the
mirrored state (no I/O).

Free GPUs and their memory per node, pools, quota use per scope, model
priorities, vLLM builds, and each model's health (from placement's
verdict, verdict.py). The placer (placer.py), displace.py and the admin
API read these; nothing here writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from app.control import state as s
from app.control.placement.verdict import NoFit

DEFAULT_POOL = "default"

HealthState = Literal["ok", "degraded", "unplaceable"]


def gpu_free_mib(gpu: s.GpuInfo) -> int | None:
    """The memory a GPU not held by any replica offers, in MiB; None if unknown.

    The discovered free memory when the agent reports it (something outside
    llmgw may use the GPU), else its total; 0 means the agent could not tell,
    and an unknown GPU is not refused for memory: the engine says so if it
    does not fit.
    """
    # `memory_free_mib` is read only if the inventory shape carries it (an
    # agent reporting it comes with another change); `memory_mib` is the total.
    free = getattr(gpu, "memory_free_mib", None)
    if isinstance(free, int) and free > 0:
        return free
    return gpu.memory_mib or None


def gpu_holders(replicas: Mapping[str, s.Replica]) -> dict[str, dict[int, str]]:
    """Node -> GPU index -> the replica holding it. Draining replicas hold
    theirs until stopped, as in placement (placer.py, `Placer._count`)."""
    held: dict[str, dict[int, str]] = {}
    for rid in sorted(replicas):
        rep = replicas[rid]
        on = held.setdefault(rep.node, {})
        for index in rep.gpus:
            on.setdefault(index, rid)
    return held


def gpu_use(node: s.NodeInfo, holders: Mapping[int, str]) -> tuple[int, int]:
    """(free, used) GPUs of `node`: used ones are held by a replica."""
    used = sum(1 for g in node.gpus if g.index in holders)
    return len(node.gpus) - used, used


def node_pool(conf: s.NodeConf | None) -> str:
    return conf.pool if conf is not None else DEFAULT_POOL


def profile_of(spec: s.ModelSpec, name: str) -> s.Profile | None:
    """The profile a replica runs, by name; the first one if the name is gone."""
    profiles = spec.profile_list
    for p in profiles:
        if p.name == name:
            return p
    return profiles[0] if profiles else None


def replica_priority(models: Mapping[str, s.ModelSpec], rep: s.Replica) -> int:
    spec = models.get(rep.model)
    prof = profile_of(spec, rep.profile) if spec is not None else None
    return prof.priority if prof is not None else 0


def quota_use(models: Mapping[str, s.ModelSpec], replicas: Mapping[str, s.Replica]
              ) -> dict[str, int]:
    """GPUs held per quota scope by the replicas of the models naming it.

    Draining replicas do not count: they are on their way out within the
    drain period, and counting them would stop a changed model's new replica
    from taking the place of the old one in a scope at its quota.
    """
    used: dict[str, int] = {}
    for r in replicas.values():
        spec = models.get(r.model)
        if spec is None or spec.quota is None or r.draining_since is not None:
            continue
        used[spec.quota] = used.get(spec.quota, 0) + len(r.gpus)
    return used


def quota_report(models: Mapping[str, s.ModelSpec], replicas: Mapping[str, s.Replica],
                 quotas: Mapping[str, s.Quota]) -> list[dict[str, Any]]:
    """Every scope with a quota or a model naming it: its limit (None: none
    set, unlimited), the GPUs its replicas hold and its models."""
    used = quota_use(models, replicas)
    members: dict[str, list[str]] = {}
    for name, spec in models.items():
        if spec.quota is not None:
            members.setdefault(spec.quota, []).append(name)
    out = []
    for scope in sorted(quotas.keys() | members.keys()):
        q = quotas.get(scope)
        out.append({"scope": scope, "max_gpus": q.max_gpus if q is not None else None,
                    "used_gpus": used.get(scope, 0), "models": sorted(members.get(scope, []))})
    return out


# --- health --------------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    """How a model stands in placement: `ok` (its minimum is placed),
    `degraded` (some, not all), `unplaceable` (none placed, none fits)."""

    state: HealthState
    detail: str = ""
    # Node -> why refused, for the few nodes per reason the verdict names.
    reasons: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "detail": self.detail, "reasons": self.reasons}


def model_health(spec: s.ModelSpec, replicas: Iterable[s.Replica], nofit: NoFit | None,
                 displaced: Mapping[str, str] | None = None) -> Health:
    """`replicas`: the model's replicas (draining ones are ignored);
    `nofit`: placement's verdict when one more does not fit, else
    None; `displaced`: replica id -> why it was displaced, for replicas of
    this model drained to make room for a higher-priority one."""
    want = spec.replica_range.min
    placed = sum(1 for r in replicas if r.draining_since is None)
    notes = [f"{rid}: {why}" for rid, why in sorted((displaced or {}).items())]
    if placed >= want:
        return Health("ok", "; ".join(notes))
    # The nodes the verdict names, not every node: at 10,000 nodes one
    # reason per node was ~0.5 MB per waiting model in GET /admin/models.
    reasons = nofit.named() if nofit is not None else {}
    if nofit is None:
        detail = f"{placed} of {want} replicas placed; placing"
    elif not reasons:
        detail = f"{placed} of {want} replicas placed; no nodes"
    else:
        detail = f"{placed} of {want} replicas placed; no node fits"
    detail = "; ".join([detail, *notes])
    state: HealthState = "unplaceable" if placed == 0 and nofit is not None else "degraded"
    return Health(state, detail, reasons)


def no_vllm_build(node: s.NodeInfo, conf: s.NodeConf | None, cpu: bool = False) -> str:
    """Why `node` has no vLLM build to run a replica with, or "": on its
    GPUs, or with `cpu` (a profile of gpus 0) on its CPUs, which only the
    `cpu` build (or an operator's own vLLM) does. Agents older than engine
    builds report none (None): not judged."""
    if conf is not None and conf.engine_build == "none":
        return "engine build set to none"
    if node.vllm_build == "":
        first = (node.vllm_build_check.splitlines() or ["not reported yet"])[0]
        return f"no usable vLLM build ({first})"
    if node.vllm_build is None:
        return ""
    if cpu and node.vllm_build not in ("cpu", "operator"):
        return f"vLLM build {node.vllm_build} runs on GPUs: a gpus 0 replica needs the cpu build"
    if not cpu and node.vllm_build == "cpu":
        return "vLLM build cpu runs on CPUs: a GPU replica needs a CUDA build"
    return ""


def quota_refusal(name: str, spec: s.ModelSpec, prof: s.Profile,
                  replicas: Mapping[str, s.Replica], quotas: Mapping[str, s.Quota],
                  models: Mapping[str, s.ModelSpec] | None) -> str:
    """Why the model's scope cannot take this replica's GPUs; "" if it can."""
    if spec.quota is None or spec.quota not in quotas or prof.gpu_count == 0:
        return ""
    use = quota_use(models if models is not None else {name: spec}, replicas)
    held, cap = use.get(spec.quota, 0), quotas[spec.quota].max_gpus
    if held + prof.gpu_count <= cap:
        return ""
    return f"quota {spec.quota}: {held} of {cap} GPUs held, needs {prof.gpu_count} more"
