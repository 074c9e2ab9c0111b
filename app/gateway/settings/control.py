"""The control plane's settings: leadership (its lease), the leader's
reconcile passes and drains, the usage snapshots they read, load-based
scaling, and how long a node unheard from keeps its replicas. Read by
app/control and the gateway that runs it."""

from __future__ import annotations

from pydantic import Field

from app.gateway.settings._group import Group


class ControlSettings(Group):
    # --- leadership -----------------------------------------------------------
    # Lease TTL in seconds. A crashed leader is replaced after at most this
    # long; shorter fails over faster but loses leadership to etcd hiccups
    # (with TTL 3 a lease expired while a 3-member etcd elected a new leader;
    # keepalives stalled 7-8 s).
    lease_ttl: int = Field(10, ge=1)
    # How often a gateway, while its mirror shows no leader, tries to win,
    # and renews a lease it has yet to get back. Shorter: faster takeover
    # after a clean stop. A held lease is renewed every `renew_interval`.
    election_interval: float = Field(0.5, gt=0)
    # The three are checked together at start, as client-go checks its lease
    # duration, renew deadline and retry period: lease_ttl >= 3 x
    # election_interval (three renewals per lease) and, with etcd, lease_ttl
    # >= 2 x etcd_timeout (a renewal that hangs until its deadline leaves
    # time for another before the lease runs out): Settings._check_timings().

    @property
    def renew_interval(self) -> float:
        """How often a held lease is renewed: a fifth of its TTL (five tries
        a lease; etcd's own client renews at a third), never more often than
        `election_interval`. A renewal costs a gateway 1.5-3 ms of CPU when
        idle (grpc's stream write and read, cold): every 0.5 s, the largest
        of an idle gateway's costs (docs/design/control-plane.md, "Election")."""
        return max(self.election_interval, self.lease_ttl / 5)

    # --- the leader's reconciler ------------------------------------------------
    # Seconds between reconcile passes when nothing changes; catalog and node
    # changes wake it at once. Shorter costs CPU on the leader only.
    reconcile_interval: float = 2.0
    # The cap on a drain: a replica being removed is out of every router at
    # once, and its engine is stopped when the gateways' usage snapshots
    # show no request left on it, or after this long whatever they show.
    # Must exceed request_timeout, or a drain could cut a stream the proxy
    # would still have let run. Longer: a gateway that stopped reporting
    # (an older version during an upgrade) holds a drained replica's GPUs
    # that long.
    drain_seconds: float = Field(660.0, gt=0)

    # --- usage snapshots (usage/{gateway}) ---------------------------------------
    # How often a gateway looks at its in-flight counts and writes its
    # snapshot if they changed. Shorter: drains end sooner after their last
    # request, for more store writes from busy gateways.
    usage_interval: float = Field(2.0, gt=0)
    # Last-use times alone are written at most this often. The leader calls
    # a model idle only this (plus usage_interval) after its idle_timeout,
    # so a longer value stops idle models later, a shorter one writes more.
    usage_refresh: float = Field(30.0, gt=0)

    # --- load-based scaling (docs/design/control-plane.md, "Scaling on load") ---------------------
    # Seconds a model's engines' load must stay below what one replica fewer
    # would serve before the leader drains one replica (and as long again
    # before the next). Up is at once. Longer: fewer engine reloads when load
    # comes and goes (a vLLM load takes minutes), and GPUs held that long
    # after a burst; shorter frees them sooner and may drain a replica that
    # the next burst needs again.
    scale_down_window: float = Field(300.0, gt=0)
    # Requests per replica (the engine's running + waiting) to scale at, for
    # a model whose spec sets no `load_target`. Lower: more replicas and less
    # queueing for the same load; higher: fuller batches on fewer GPUs. Not
    # measured on a real engine; set `load_target` per model from its own
    # latency under load.
    default_load_target: int = Field(16, ge=1, le=10000)
    # Seconds a LoRA adapter's requests must stay below what one replica
    # fewer would serve before the leader takes it off one replica (and as
    # long again before the next); it is unloaded drain_seconds after, once
    # its streams there are over. Shorter frees adapter slots sooner and
    # reloads adapters (seconds each) when load comes back.
    adapter_shrink_after: float = Field(60.0, gt=0)
    # Seconds an engine's queue must stay non-empty (or its KV cache full)
    # before the leader adds replicas for it whatever the load target. The
    # second replica comes this much (plus a poll, a snapshot and a pass:
    # 3 s at most with the defaults) after saturation. Shorter: replicas
    # for bursts an engine would have worked off alone (each reload of a
    # vLLM engine takes minutes, and the surplus stays a scale-down window);
    # longer: requests wait that much longer in a full engine.
    saturated_after: float = Field(5.0, gt=0, le=3600)

    # --- restarts and handovers ---------------------------------------------------
    # Seconds the leader keeps the replicas of a node it has not heard from
    # (no `nodes/` key), counted from when it first saw the node absent or
    # took the lead, whichever is later. Meanwhile the router leaves them out
    # and their GPUs stay reserved. It must cover an agent restart or upgrade
    # and a gateway handover or `llmgw serve` restart on the embedded store
    # (which drops every node key until agents beat again): each takes
    # seconds, plus up to two 5 s heartbeat periods before an agent that
    # found no gateway beats again. 60 s covers that with room. Longer: a
    # dead node's models stay unserved longer (node_ttl + node_grace after
    # its last heartbeat). Shorter: a slow restart reloads every model.
    node_grace: float = Field(60.0, ge=0)
