"""The leader's reconcile loop: gather state, call `plan()`, apply it fenced.

`tick()` is one pass and returns what it did; `run()` only repeats it, woken
early by any change the mirror sees (a catalog edit, a node joining), so a
PUT is acted on at once rather than at the next interval.

A pass plans only on state the leader has: not before its mirror has reached
the revision at which it took the lead (its predecessor's last writes), nor
before it has seen its own last write. Each write is conditional on what the
plan read: a create on the replica key being absent, a drain or a delete on
the replica's mod revision as mirrored. A write refused for either reason
ends the pass; the next one plans again on a mirror that has caught up.

Usage comes from the gateways' snapshots (app/control/usage.py): a drain
ends when every gateway has let go of the replica and none has a request on
it (or at the cap, `drain_seconds`), and a model with `replicas.min` 0
stops after its idle timeout. Last use never counts from before this leader
took the lead, nor goes back: a handover, or a gateway restart that lost
its counts, must not make a model look idle. The snapshots' engine loads
drive load-based scaling (app/control/plan/scaling.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from app.control import state as s
from app.control import usage
from app.control.keys import SecretRing
from app.control.leader import Elector, NotLeader
from app.control.mirror import Mirror
from app.control.placement.agentversion import Window
from app.control.plan.phases import Plan
from app.control.plan.planner import PlanInput, PlanPolicy, plan, wanted
from app.control.plan.scaling import Scaler
from app.store.base import Compare, Delete, Put, Store, StoreError, StoreUnavailable

logger = logging.getLogger(__name__)


class WriteRefused(Exception):
    """The store refused a leader write: the `leader` key is no longer ours,
    or the replica changed since the mirror showed it."""


@dataclass
class TickResult:
    acted: bool = False
    skipped: str = ""
    plan: Plan = field(default_factory=Plan)
    # Why the plan was not applied to the end ("" = every write went through).
    refused: str = ""


@dataclass(frozen=True)
class ReconcileSettings:
    """The leader's loop's settings (app/gateway/settings): the drain cap,
    the pass interval, the node grace, how late a use can reach the leader
    (`idle_slack`: the usage snapshots' refresh and interval), load-based
    scaling's window, default target and saturation delay, the agent
    versions new replicas go to, and how new replica ids end."""

    drain_seconds: float
    interval: float
    node_grace: float
    idle_slack: float = 0.0
    scale_down_window: float = 300.0
    default_load_target: int = 16
    saturated_after: float = 5.0
    agent_window: Window | None = None
    new_suffix: Callable[[], str] = field(default=lambda: secrets.token_hex(4))


class Reconciler:
    def __init__(
        self,
        store: Store,
        mirror: Mirror,
        elector: Elector,
        settings: ReconcileSettings,
        *,
        secrets: SecretRing | None = None,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._elector = elector
        # None: replicas are not held to a secret (tests of other rules).
        self._secrets = secrets
        self._drain_seconds = settings.drain_seconds
        self._interval = settings.interval
        self._node_grace = settings.node_grace
        # How late a use can reach us (the usage snapshots' refresh and
        # interval): a model is idle only that much after its idle timeout.
        self._idle_slack = settings.idle_slack
        self._policy = PlanPolicy(
            drain_seconds=settings.drain_seconds, new_suffix=settings.new_suffix,
            node_grace=settings.node_grace, idle_slack=settings.idle_slack,
            agent_window=settings.agent_window)
        self._wall = wall  # for draining_since, which every gateway reads
        self._clock = clock  # for the node grace and scaling, which only this leader counts
        self._scaler = Scaler(window=settings.scale_down_window,
                              default_target=settings.default_load_target,
                              saturated_after=settings.saturated_after)
        # The revision of our last write. It must be in the mirror before the
        # next pass plans on it, or a replica just created would be created
        # twice.
        self.written_revision = 0
        self.last_unplaced: dict[str, str] = {}
        # The lead we hold (its revision) and when we first saw it, by clock.
        self._term = 0
        self._led_since = 0.0
        # Nodes with replicas but no `nodes/` key: when this leader first saw
        # each one absent.
        self._absent_since: dict[str, float] = {}
        # The latest use of each model seen in any snapshot, by wall time;
        # and the wall time at which we took the lead.
        self._last_use: dict[str, float] = {}
        # When the leader replaced a failed replica, per model (retry backoff).
        self._replaced: dict[str, list[float]] = {}
        self._led_since_wall = 0.0
        self.last_reasons: dict[str, str] = {}

    async def tick(self) -> TickResult:
        skipped = self._not_yet()
        if skipped:
            return TickResult(skipped=skipped)
        state, read_at = self._read()
        # plan() is pure and reads only what was taken above (the mirror's
        # views are replaced, never changed, when a key changes): it runs in
        # a worker thread, so a large fleet's pass (hundreds of ms at 10,000
        # nodes) does not stall this gateway's router, which the GIL lets
        # run every few milliseconds meanwhile (docs/design/scale.md).
        p = await asyncio.to_thread(plan, state, self._policy)
        self._say(p)
        result = TickResult(plan=p)
        replicas = state.replicas
        for rid in set(state.failed) & set(p.drain):
            logger.warning("replica %s of %s kept dying on %s: placing it again elsewhere",
                           rid, replicas[rid].model, replicas[rid].node)
            self._replaced.setdefault(replicas[rid].model, []).append(self._wall())
        if p.empty:
            return result
        try:
            await self._apply(p, state, read_at)
        except (NotLeader, WriteRefused) as exc:
            logger.warning("stopped applying the plan: %s", exc)
            result.refused = str(exc)
        result.acted = True
        return result

    def _not_yet(self) -> str:
        """Why this pass must not plan ("": it may): not leading, or the
        mirror behind the lead's or our own last write."""
        if not self._elector.is_leader:
            return "not leader"
        lead = self._elector.lead_revision
        if lead != self._term:
            # A new lead (a handover, a restart): no node has had a chance to
            # reach us yet, so every grace starts now.
            self._term, self._led_since = lead, self._clock()
            self._led_since_wall = self._wall()
            self._absent_since.clear()
            self._last_use.clear()
            self._scaler.reset()
        if not self._mirror.ready or self._mirror.revision < lead:
            return ("mirror behind the revision at which we took the lead "
                    f"({self._mirror.revision} < {lead})")
        if self._mirror.revision < self.written_revision:
            return "mirror behind our last write"
        return ""

    def _read(self) -> tuple[PlanInput, dict[str, int]]:
        """What a pass plans on, and the mod revision of each replica read
        (its writes are conditioned on them)."""
        # One synchronous read of the mirror: the plan and the revisions its
        # writes are conditioned on come from the same state.
        models, nodes, replicas = (
            self._mirror.models(), self._mirror.nodes(), self._mirror.replicas())
        read_at = {rid: kv.mod_revision for rid in replicas
                   if (kv := self._mirror.get(s.REPLICAS + rid)) is not None}
        usages = self._mirror.usages()
        gateways = self._mirror.parsed(s.GATEWAYS, s.GatewayInfo)
        # A drained replica's key was last written by its drain.
        inflight = usage.drain_inflight(
            {rid: read_at[rid] for rid, r in replicas.items()
             if r.draining_since is not None and rid in read_at}, gateways, usages)
        now = self._wall()
        last = self._last_uses(
            models, usages, {r.model for r in replicas.values() if r.draining_since is None})
        # Load-based scaling (docs/design/control-plane.md, "Scaling on load"): the count is
        # decided here, where the scale-down window's state lives; the plan
        # takes it as an input and stays pure.
        loads = usage.replica_loads(usages, [rid for rid, r in replicas.items()
                                             if r.engine == "llamacpp"])
        floors = {name: wanted(spec, last.get(name), now, self._idle_slack)
                  for name, spec in models.items()}
        targets = self._scaler.step(models, replicas, loads, floors, self._clock(),
                                    usage.replica_queues(usages))
        statuses = self._mirror.statuses()
        # The secret replicas are held to: the new one only once every live
        # gateway derives with it (keys.SecretRing.fleet_secret_id).
        secret_id = unrecorded = ""
        if self._secrets is not None:
            secret_id = self._secrets.fleet_secret_id(g.secret for g in gateways.values())
            unrecorded = self._secrets.replica_secret_id("")
        return PlanInput(
            models, nodes, replicas, now=now,
            absent_for=self._absences(nodes, {r.node for r in replicas.values()}),
            statuses=statuses, failed=self._failed_to_replace(replicas, statuses),
            inflight=inflight, last_used=last, nodeconfs=self._mirror.nodeconfs(),
            quotas=self._mirror.quotas(), targets=targets, loads=loads,
            secret_id=secret_id, unrecorded_secret_id=unrecorded), read_at

    def _say(self, p: Plan) -> None:
        """Logs what the plan could not place, and its rollout decisions,
        when they change."""
        if p.unplaced != self.last_unplaced:
            for model, why in p.unplaced.items():
                logger.warning("cannot place a replica of %s: %s", model, why)
        self.last_unplaced = p.unplaced
        if p.reasons != self.last_reasons:
            for model, why in p.reasons.items():
                logger.info("rolling %s: %s", model, why)
        self.last_reasons = p.reasons

    async def _apply(self, p: Plan, state: PlanInput, read_at: Mapping[str, int]) -> None:
        """Writes the plan, each write fenced and conditioned on what was read."""
        replicas, inflight = state.replicas, state.inflight
        for rep in p.create:
            logger.info("placing replica %s of %s on %s gpus=%s",
                        rep.id, rep.model, rep.node, rep.gpus)
            key = s.REPLICAS + rep.id
            await self._write([Compare.absent(key)],
                              [Put(key, rep.model_dump_json().encode())])
        for rid in p.drain:
            logger.info("draining replica %s", rid)
            key = s.REPLICAS + rid
            drained = replicas[rid].model_copy(update={
                "draining_since": self._wall(),
                "drain_reason": p.drain_reasons.get(rid, "")})
            await self._write([Compare.modified_at(key, read_at[rid])],
                              [Put(key, drained.model_dump_json().encode())])
        for rid in p.delete:
            if replicas[rid].draining_since is None or inflight.get(rid) == 0:
                logger.info("removing replica %s", rid)
            else:
                logger.warning("removing replica %s: drain cap of %.0f s reached with %s "
                               "requests in flight", rid, self._drain_seconds,
                               inflight.get(rid, "unknown"))
            key = s.REPLICAS + rid
            await self._write([Compare.modified_at(key, read_at[rid])],
                              [Delete(key), Delete(s.STATUS + rid)])

    def _last_uses(self, models: Collection[str], usages: Mapping[str, s.Usage],
                   running: set[str]) -> dict[str, float]:
        """Each model's last use: the latest any snapshot showed while we
        lead. For a model with replicas, never before we took the lead: a
        new leader has not heard from every gateway yet, and a handover must
        stop no engine (DESIGN invariant 10). A model without replicas is
        started only on a use a snapshot shows."""
        for model, at in usage.last_used(usages).items():
            self._last_use[model] = max(self._last_use.get(model, at), at)
        for gone in self._last_use.keys() - set(models):
            del self._last_use[gone]
        out = {m: at for m, at in self._last_use.items() if m in models}
        for m in running & set(models):
            out[m] = max(out.get(m, self._led_since_wall), self._led_since_wall)
        return out

    def _absences(self, present: Collection[str], placed_on: set[str]) -> dict[str, float]:
        """Seconds each node holding replicas has been absent from `nodes/`,
        counted from when this leader first saw it absent and never from
        before it took the lead."""
        now = self._clock()
        missing = placed_on.difference(present)
        for node in sorted(missing - self._absent_since.keys()):
            logger.warning("node %s not heard from: its replicas are out of the router and "
                           "kept for up to %.0f s", node, self._node_grace)
        for node in sorted(self._absent_since.keys() - missing):
            if node in present:
                logger.info("node %s is back after %.1f s", node,
                            now - max(self._absent_since[node], self._led_since))
        self._absent_since = {n: self._absent_since.get(n, now) for n in missing}
        return {n: now - max(t, self._led_since) for n, t in self._absent_since.items()}

    def _failed_to_replace(self, replicas: Mapping[str, s.Replica],
                           statuses: Mapping[str, s.ReplicaStatus]) -> set[str]:
        """Replicas their agent gave up on whose model's retry backoff is
        over: the first is replaced at once, each later one within the hour
        after a doubling wait (30 s, 60 s, ... up to 10 min), so a model that
        dies everywhere does not churn the fleet."""
        now = self._wall()
        out = set()
        for rid, st in statuses.items():
            rep = replicas.get(rid)
            if rep is None or rep.draining_since is not None or not (
                    st.given_up and st.phase == "failed"):
                continue
            recent = [t for t in self._replaced.get(rep.model, []) if now - t < 3600]
            self._replaced[rep.model] = recent
            wait = 0.0 if not recent else min(600.0, 30.0 * 2 ** (len(recent) - 1))
            if now - max([st.updated, *recent]) >= wait:
                out.add(rid)
        return out

    async def _write(self, conditions: list[Compare], ops: list[Put | Delete]) -> None:
        res = await self._store.txn(self._elector.fence() + conditions, self._elector.signed(ops))
        # Refused or not, the next pass must not plan on a mirror older than
        # this answer: a refusal means the store holds something we have not
        # seen yet.
        self.written_revision = max(self.written_revision, res.revision)
        if not res.succeeded:
            raise WriteRefused(
                f"write to {ops[0].key} refused at revision {res.revision}: the leader key "
                "is no longer ours or the replica changed since it was read")

    async def run(self) -> None:
        while True:
            seen = self._mirror.revision
            try:
                await self.tick()
            except StoreUnavailable as exc:
                logger.debug("reconcile pass failed: %s", exc)  # the store says so once
            except StoreError as exc:
                logger.warning("reconcile pass failed: %s", exc)
            except Exception:
                logger.exception("reconcile pass crashed")
            # A saturation's delay ending is a reason to look again at once:
            # the snapshots that show it are not written again while the
            # queue holds still.
            due = self._scaler.next_due(self._clock())
            await self._mirror.wait_past(
                seen, self._interval if due is None else min(self._interval, due + 0.01))
