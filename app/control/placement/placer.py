"""Where one more replica of a model goes. Pure functions, no I/O.

`place()` takes the model and the fleet and returns a `Fit` or a `NoFit`
(verdict.py) whose refusals say why each node was refused, in the manner of
Nomad's scheduler: feasibility (agent version, drain, cordon, pool, node
selector, engine: a `Constraint`) -> fit (free GPUs and their memory,
quota: a `Dimension`) -> score (spread) -> pick. `place_any()` over
`placer_of()` is THE decision: the leader's pass (app/control/plan/),
the gateways' publisher, the admin API and /metrics all ask it, with the
same inputs. displace.py says which lower-priority replicas give way when
a model's minimum does not fit.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping
from typing import Protocol

from app.control import gpuhealth
from app.control import state as s
from app.control.placement import agentversion, fleet
from app.control.placement.verdict import Constraint, Dimension, Fit, NoFit, Refusal


def _gib(mib: int) -> str:
    return f"{mib / 1024:.0f} GiB"


def place(
    name: str,
    spec: s.ModelSpec,
    nodes: Mapping[str, s.NodeInfo],
    replicas: Mapping[str, s.Replica],
    *,
    profile: s.Profile | None = None,
    nodeconfs: Mapping[str, s.NodeConf] | None = None,
    quotas: Mapping[str, s.Quota] | None = None,
    models: Mapping[str, s.ModelSpec] | None = None,
) -> Fit | NoFit:
    """Picks a node (and GPUs) for one more replica of `name`.

    It runs `profile`, by default the spec's first. An external model has
    none: never placed. `nodeconfs` (by node) bring cordons, drains and
    pools; `quotas` (by scope) cap the GPUs of the models naming a scope,
    whose use is counted over the replicas of `models` (by default this
    model alone). Left out, each is as if nothing were configured, and the
    agent window is this gateway's default (a `Placer` takes another).
    """
    placer = Placer(nodes, replicas, nodeconfs=nodeconfs, quotas=quotas, models=models)
    return placer.place(name, spec, profile=profile)


def place_any(placer: Placer, name: str, spec: s.ModelSpec) -> tuple[Fit | NoFit, s.Profile]:
    """Where one more replica of `name` goes, as the leader's pass decides
    it (app/control/plan/placing.py): the first of the model's profiles, in the order
    given, that fits somewhere (an operator lists the preferred way first:
    an H100 pool, then an A10 one). When none fits, every node's refusals
    name each profile's, and the profile is the first. Not for an
    external model: it has no profile and is never placed."""
    profiles = spec.profile_list
    refusals: list[tuple[s.Profile, NoFit]] = []
    for prof in profiles:
        fit = placer.place(name, spec, profile=prof)
        if not isinstance(fit, NoFit):
            return fit, prof
        refusals.append((prof, fit))
    if len(refusals) == 1:
        return refusals[0][1], profiles[0]
    merged: dict[str, tuple[Refusal, ...]] = {}
    for prof, nofit in refusals:
        for node, whys in nofit.refusals.items():
            merged[node] = merged.get(node, ()) + tuple(
                Refusal(why.reason, why.detail, prof.name) for why in whys)
    return NoFit(merged), profiles[0]


class FleetView(Protocol):
    """What placement reads of the fleet: a gateway's mirror
    (app/control/mirror.py), its views replaced, never changed, on a change."""

    def models(self) -> Mapping[str, s.StoredModel]: ...
    def nodes(self) -> Mapping[str, s.NodeInfo]: ...
    def replicas(self) -> Mapping[str, s.Replica]: ...
    def nodeconfs(self) -> Mapping[str, s.NodeConf]: ...
    def quotas(self) -> Mapping[str, s.Quota]: ...


def placer_of(view: FleetView, agent_versions: agentversion.Window | None) -> Placer:
    """A placer over `view` with every input the leader's pass gives its own
    (plan.py: node confs for cordons, drains, pools, labels and cleared
    GPUs; quotas over every model's replicas; the agent window), so that a
    gateway that says whether a model can be placed says what the leader
    decides (docs/design/placement.md). Leaving one out made every
    gateway hold requests 300 s for a model no node could take."""
    return Placer(view.nodes(), view.replicas(), nodeconfs=view.nodeconfs(),
                  quotas=view.quotas(), models=view.models(), agent_versions=agent_versions)


_NONE: frozenset[int] = frozenset()
# The refusals that say nothing of the node: one each, not one per node.
_DRAINING = Refusal(Constraint.DRAINING, "draining")
_CORDONED = Refusal(Constraint.CORDONED, "cordoned")
_CPU_NODE = Refusal(Constraint.CPU_NODE, "llamacpp replicas go to CPU nodes")

# What a node's fit depends on besides the node: pool, engine, GPUs, MiB
# each, the node selector's pairs.
_Shape = tuple[str, str, int, int | None, tuple[tuple[str, str], ...]]


class Placer:
    """`place()` for many replicas in one pass over the same fleet.

    Each node's feasibility and fit (free GPUs, memory) are worked out once
    per profile shape and again only when a replica is added there, so a
    pass placing hundreds of replicas on a large fleet does not redo every
    node's GPUs for each (docs/design/scale.md). Call `add()` for
    each replica placed, after putting it into `replicas`.

    The pick is the best score; scores only grow as replicas are added (a
    node's count goes up, its free GPUs down, and nothing frees), so the
    nodes that fit are kept in a heap per shape by (replicas, -free GPUs,
    name), refreshed lazily when a node's entry is stale: a node with no
    replica of the model always beats one with, so the pick is the heap's
    first such node, else the best of the few nodes holding the model.
    """

    def __init__(
        self,
        nodes: Mapping[str, s.NodeInfo],
        replicas: Mapping[str, s.Replica],
        *,
        nodeconfs: Mapping[str, s.NodeConf] | None = None,
        quotas: Mapping[str, s.Quota] | None = None,
        models: Mapping[str, s.ModelSpec] | None = None,
        agent_versions: agentversion.Window | None = None,
    ) -> None:
        # Agents outside it get no new replicas (agentversion.py).
        self._window = agent_versions or agentversion.default_window()
        self._nodes = nodes
        self._replicas = replicas
        self._confs = nodeconfs or {}
        self._quotas = quotas or {}
        self._models = models
        # GPUs held and replicas per node, per model and node: built on the
        # first place(), so a pass that places nothing (a steady fleet)
        # never walks every replica for them.
        self._indexed = False
        self._used: dict[str, set[int]] = {}
        self._on_node: dict[str, list[str]] = {}
        self._total: dict[str, int] = {}
        self._per_model: dict[str, dict[str, int]] = {}
        # Per shape, per node: (GPUs that fit, free GPUs) or why it cannot.
        self._fits: dict[_Shape, dict[str, tuple[list[int], int] | Refusal]] = {}
        # Per shape: (replicas, -free GPUs, node, node version) of nodes that
        # fit, among the groups grown into it (`_grow`): the nodes grouped by
        # the replicas they held at the first pick, fewest first.
        self._heaps: dict[_Shape, list[tuple[int, int, str, int]]] = {}
        self._groups: list[tuple[int, list[str]]] | None = None
        self._grown: dict[_Shape, int] = {}
        self._versions: dict[str, int] = {}
        self._refusals: dict[str, Refusal | None] = {}
        # Per (shape, quota refusal): the NoFit while no replica was added
        # since, the same for every model of that shape (a full fleet's
        # waiting models each scanned every node for it).
        self._nofits: dict[tuple[_Shape, str], NoFit] = {}

    def _count(self, r: s.Replica) -> None:
        """Counts `r` on its node: its GPUs taken (draining replicas hold
        theirs until stopped), one more replica there, of its model too."""
        # No setdefault: its default (a new set, list, dict) was made for
        # every replica, 20,000 of them at a 10,000-node pass's first pick.
        node = r.node
        used = self._used.get(node)
        if used is None:
            self._used[node] = set(r.gpus)
        else:
            used.update(r.gpus)
        self._total[node] = self._total.get(node, 0) + 1
        ids = self._on_node.get(node)
        if ids is None:
            self._on_node[node] = [r.id]
        else:
            ids.append(r.id)
        on = self._per_model.get(r.model)
        if on is None:
            self._per_model[r.model] = {node: 1}
        else:
            on[node] = on.get(node, 0) + 1

    def _index(self) -> None:
        if self._indexed:
            return
        self._indexed = True
        for r in self._replicas.values():
            self._count(r)

    def add(self, r: s.Replica) -> None:
        if not self._indexed:
            return  # already in `replicas`, where _index() will count it
        self._count(r)
        self._versions[r.node] = self._versions.get(r.node, 0) + 1
        for fits in self._fits.values():
            fits.pop(r.node, None)
        self._nofits.clear()

    def _found(self, shape: _Shape, node: s.NodeInfo, prof: s.Profile,
               need_mib: int | None) -> tuple[list[int], int] | Refusal:
        fits = self._fits.setdefault(shape, {})
        found = fits.get(node.name)
        if found is None:
            found = fits[node.name] = self._fit(node, prof, need_mib)
        return found

    def _entry(self, name: str, found: tuple[list[int], int]) -> tuple[int, int, str, int]:
        return (self._total.get(name, 0), -found[1], name, self._versions.get(name, 0))

    def _next_group(self, shape: _Shape) -> int | None:
        """How many replicas the nodes of the next group not yet in the
        shape's heap held when grouped; None when every group is in."""
        if self._groups is None:
            by_count: dict[int, list[str]] = {}
            for node in self._nodes:
                by_count.setdefault(self._total.get(node, 0), []).append(node)
            self._groups = sorted(by_count.items())
        i = self._grown.get(shape, 0)
        return self._groups[i][0] if i < len(self._groups) else None

    def _grow(self, shape: _Shape, prof: s.Profile, need_mib: int | None) -> None:
        """Puts the next group's nodes that fit into the shape's heap. A
        node's count only grows, so one not in the heap yet holds at least
        its group's: a pass placing 2,000 replicas on a 10,000-node fleet
        works out the fits of the emptiest nodes, not of every node."""
        assert self._groups is not None
        i = self._grown.get(shape, 0)
        self._grown[shape] = i + 1
        heap = self._heaps[shape]
        for node in self._groups[i][1]:
            found = self._found(shape, self._nodes[node], prof, need_mib)
            if not isinstance(found, Refusal):
                heapq.heappush(heap, self._entry(node, found))

    def _quick(self, name: str, shape: _Shape, prof: s.Profile,
               need_mib: int | None) -> Fit | None:
        """The pick the full scan would make, from the heap; None when no
        node fits (the scan then says why, node by node)."""
        heap = self._heaps.setdefault(shape, [])
        same_model = self._per_model.get(name, {})
        aside: list[tuple[int, int, str, int]] = []
        pick: str | None = None
        while True:
            # The nodes holding fewer replicas than any in the heap may beat
            # them: add their group first (or the next, once it is empty).
            nxt = self._next_group(shape)
            if nxt is not None and (not heap or heap[0][0] >= nxt):
                self._grow(shape, prof, need_mib)
                continue
            if not heap:
                break
            node = heap[0][2]
            if heap[0][3] != self._versions.get(node, 0):
                heapq.heappop(heap)  # stale: placed on since; its score only grew
                found = self._found(shape, self._nodes[node], prof, need_mib)
                if not isinstance(found, Refusal):
                    heapq.heappush(heap, self._entry(node, found))
                continue
            if same_model.get(node, 0) == 0:
                pick = node
                break
            aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        if pick is None:
            # Every node that fits holds the model: the best of those.
            held = []
            for name_ in same_model:
                holder = self._nodes.get(name_)
                if holder is None:
                    continue
                found = self._found(shape, holder, prof, need_mib)
                if not isinstance(found, Refusal):
                    held.append(((same_model[name_], self._total.get(name_, 0), -found[1],
                                  name_), found[0]))
            if not held:
                return None
            best = min(held, key=lambda c: c[0])
            return Fit(best[0][3], list(best[1]))
        found = self._found(shape, self._nodes[pick], prof, need_mib)
        assert not isinstance(found, Refusal)
        return Fit(pick, list(found[0]))

    def place(self, name: str, spec: s.ModelSpec, *,
              profile: s.Profile | None = None) -> Fit | NoFit:
        profiles = spec.profile_list
        if not profiles:
            return NoFit({})
        prof = profile if profile is not None else profiles[0]
        self._index()
        need_mib = round(prof.gpu_memory_gib * 1024) if prof.gpu_memory_gib else None
        quota_refusal = fleet.quota_refusal(name, spec, prof, self._replicas, self._quotas,
                                             self._models)
        shape = (prof.pool, prof.engine, prof.gpu_count, need_mib,
                 tuple(sorted(prof.node_selector.items())))
        if not quota_refusal:
            quick = self._quick(name, shape, prof, need_mib)
            if quick is not None:
                return quick
        known = self._nofits.get((shape, quota_refusal))
        if known is not None:
            return known  # no node fits: the reasons are the shape's, not the model's
        fits = self._fits.setdefault(shape, {})
        same_model = self._per_model.get(name, {})
        over_quota = Refusal(Dimension.QUOTA, quota_refusal)
        reasons: dict[str, Refusal] = {}
        best: tuple[tuple[int, int, int, str], list[int]] | None = None
        for node in self._nodes.values():
            found = fits.get(node.name)
            if found is None:
                found = fits[node.name] = self._fit(node, prof, need_mib)
            if isinstance(found, Refusal):
                reasons[node.name] = found
                continue
            if quota_refusal:
                reasons[node.name] = over_quota
                continue
            # Spread replicas of one model first, then fill the emptiest node, so
            # that losing a node loses as few replicas of any model as possible.
            score = (same_model.get(node.name, 0), self._total.get(node.name, 0),
                     -found[1], node.name)
            if best is None or score < best[0]:
                best = (score, found[0])
        if best is None:
            nofit = self._nofits[(shape, quota_refusal)] = NoFit.of(reasons)
            return nofit
        return Fit(best[0][3], list(best[1]))

    def fits_without(self, name: str, spec: s.ModelSpec, gone: str) -> bool:
        """Whether one more replica of `name` (its first profile) would fit
        were replica `gone` stopped: asked once place() found no node for
        it, so only `gone`'s node can change its mind, unless a quota the
        model counts against frees up (then the whole fleet is asked
        again). One node's fit, not a scan of the fleet per replica (a
        rollout on a full fleet asked that of every model's old replicas)."""
        prof = spec.profile_list[0]
        if spec.quota is not None and spec.quota in self._quotas and prof.gpu_count:
            others = {k: v for k, v in self._replicas.items() if k != gone}
            return not isinstance(Placer(
                self._nodes, others, nodeconfs=self._confs, quotas=self._quotas,
                models=self._models, agent_versions=self._window).place(name, spec), NoFit)
        self._index()
        node = self._replicas[gone].node
        info = self._nodes.get(node)
        if info is None:
            return False
        held: set[int] = set()
        for rid in self._on_node.get(node, ()):
            if rid != gone:
                held.update(self._replicas[rid].gpus)
        need_mib = round(prof.gpu_memory_gib * 1024) if prof.gpu_memory_gib else None
        return not isinstance(self._fit(info, prof, need_mib, taken=held), Refusal)

    def _fit(self, node: s.NodeInfo, prof: s.Profile, need_mib: int | None,
             taken: Collection[int] | None = None) -> tuple[list[int], int] | Refusal:
        """The GPUs a replica of `prof` would take on `node` and its free
        GPUs, or why it cannot go there (quota aside). `taken`: its GPUs
        held, if not those the placer counted."""
        conf = self._confs.get(node.name)
        filtered = self._filtered(node, conf, prof)
        if filtered is not None:
            return filtered
        if prof.engine == "vllm" and prof.gpu_count == 0:
            return [], 0
        if prof.engine == "llamacpp":
            return [], 0
        # A sick GPU is out until an admin clears it (gpuhealth.py): one
        # walk of the node's GPUs (this runs for every node of the fleet).
        if taken is None:
            taken = self._used.get(node.name, _NONE)
        cleared = conf.gpu_cleared if conf is not None else {}
        free = [g for g in node.gpus
                if g.index not in taken and not gpuhealth.is_sick(g, cleared)]
        if len(free) < prof.gpu_count:
            sick = sorted(gpuhealth.sick_gpus(node, conf))
            out = "".join(f"; GPU {i} unhealthy" for i in sick)
            # Filtered when the sick GPUs alone keep it out, else exhausted.
            unheld = sum(1 for g in node.gpus if g.index not in taken)
            reason = Constraint.SICK_GPU if unheld >= prof.gpu_count else Dimension.GPUS
            return Refusal(reason, f"needs {prof.gpu_count} free GPUs, has {len(free)} of "
                                   f"{len(node.gpus)}{out}")
        if need_mib is None:
            # No memory need: the lowest free ids, without reading memory.
            ids = sorted(g.index for g in free)
            return ids[: prof.gpu_count], len(ids)
        idle = {g.index: fleet.gpu_free_mib(g) for g in free}
        # Memory as discovered, not only the count; unknown memory (None)
        # is not refused (fleet.gpu_free_mib).
        roomy = {i: m for i, m in idle.items() if m is None or m >= need_mib}
        if len(roomy) < prof.gpu_count:
            seen = ", ".join(f"GPU {i}: {_gib(m or 0)}" for i, m in sorted(idle.items()))
            return Refusal(Dimension.GPU_MEMORY,
                           f"needs {prof.gpu_count} GPUs with {_gib(need_mib)} free, has "
                           f"{len(roomy)} ({seen})")
        # With a memory need, the smallest GPUs that fit, keeping the
        # large ones for the models that need them; else (above) the lowest ids.
        order = sorted(roomy, key=lambda i: (roomy[i] or 0, i))
        return sorted(order[: prof.gpu_count]), len(idle)

    def _filtered(self, node: s.NodeInfo, conf: s.NodeConf | None,
                  prof: s.Profile) -> Refusal | None:
        """The constraint that keeps `node` out whatever it holds, in the
        order they are checked, or None (feasibility, before fit)."""
        # A fleet runs a few agent versions: each judged once per pass.
        if node.version in self._refusals:
            too_old_or_new = self._refusals[node.version]
        else:
            why = self._window.refusal(node.version)
            too_old_or_new = self._refusals[node.version] = (
                None if why is None else Refusal(Constraint.AGENT_VERSION, why))
        if too_old_or_new is not None:
            return too_old_or_new
        if conf is not None and conf.draining:
            return _DRAINING
        if conf is not None and conf.cordoned:
            return _CORDONED
        pool = fleet.node_pool(conf)
        if pool != prof.pool:
            return Refusal(Constraint.POOL,
                           f"in pool {pool}, the profile wants pool {prof.pool}")
        if prof.node_selector:
            labels = conf.labels if conf is not None else {}
            unmatched = sorted((k, v) for k, v in prof.node_selector.items()
                               if labels.get(k) != v)
            if unmatched:
                return Refusal(Constraint.NODE_SELECTOR,
                               "labels do not match node_selector "
                               + ",".join(f"{k}={v}" for k, v in unmatched))
        if prof.engine not in node.engines:
            return Refusal(Constraint.ENGINE, f"engine {prof.engine} not available")
        if prof.engine == "vllm" and (
                why := fleet.no_vllm_build(node, conf, cpu=prof.gpu_count == 0)):
            return Refusal(Constraint.ENGINE_BUILD, why)
        if prof.engine == "llamacpp" and not node.cpu_only:
            return _CPU_NODE
        return None
