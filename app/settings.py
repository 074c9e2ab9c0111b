"""Every setting of a gateway, with its default and what changing it costs.

Read from the environment with the prefix `LLMGW_` (e.g. `LLMGW_LEASE_TTL`).
`Settings` is built once by the caller (the CLI or a test) and passed down:
nothing reads the environment at import time, so one process can hold
several differently configured gateways.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.control.catalog import load_file
from app.control.keyfiles import check_key_dir
from app.control.state import DEFAULT_VLLM_VERSION, check_vllm_version

# Values a careless copy of an example file would leave in place.
_PLACEHOLDERS = {"changeme", "change-me", "secret", "changethis", "password", "xxx"}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLMGW_", extra="ignore")

    # --- where the shared state lives -------------------------------------
    # Comma-separated host:port of etcd members, or https://host:port (all of
    # them) for TLS, docs/architecture.md "TLS". Empty: the embedded store in
    # data_dir, one gateway alone (it is then always the leader).
    etcd_endpoints: str = ""
    # With https: the PEM bundle of the CA(s) that signed etcd's certificates
    # (unset: the system's CAs). Costs a handshake per kept-open connection
    # and the encryption's CPU on every call.
    etcd_ca_file: Path | None = None
    # A client certificate (PEM chain) and its unencrypted key, both or neither,
    # for etcd's --client-cert-auth; read at start (a renewed one: restart).
    etcd_cert_file: Path | None = None
    etcd_key_file: Path | None = None
    # Every key lives under this prefix, so several llmgw installations (or
    # test runs) can share one etcd.
    etcd_prefix: str = "/llmgw/"
    # Per-call deadline on etcd. Longer rides out slow disks; shorter makes a
    # dead etcd visible (503 on writes) sooner.
    etcd_timeout: float = 5.0
    # Every this many seconds the leader compacts the store's history to the
    # revision it saw one interval earlier (docs/architecture.md, A month of
    # uptime); 0 turns it off (then etcd's own --auto-compaction-* must, or
    # its space quota fills and the fleet turns read-only). Longer: more
    # history kept (etcd's database grows with writes per interval), and
    # watches lagging up to that long replay rather than resync; shorter:
    # a smaller database, and a watch lagging over one interval resyncs.
    etcd_compaction_interval: float = Field(300.0, ge=0)
    # The embedded store, the generated secret and admin token live here.
    data_dir: Path = Field(default_factory=lambda: Path.home() / ".local/share/llmgw")

    # --- secrets ------------------------------------------------------------
    # Engine keys and node tokens are derived from it (HMAC). Required with
    # etcd, where every gateway must derive the same keys; generated and kept
    # in data_dir for the embedded store.
    secret: SecretStr | None = None
    # During a rotation of `secret`, the secret it replaces: gateways still
    # accept agents' node tokens of it and derive the engine keys of
    # replicas placed under it, until the leader has replaced them all.
    # Unset it once that is done and every agent has its new token (the
    # procedure: docs/architecture.md, Security: Rotating the shared secret);
    # while set, a node token taken before the rotation still opens.
    previous_secret: SecretStr | None = None
    # Bearer token for /admin. Unset: generated into data_dir/admin-token.
    admin_token: SecretStr | None = None

    # --- leadership -----------------------------------------------------------
    # Lease TTL in seconds. A crashed leader is replaced after at most this
    # long; shorter fails over faster but loses leadership to etcd hiccups
    # (with TTL 3 a lease expired while a 3-member etcd elected a new leader;
    # keepalives stalled 7-8 s).
    lease_ttl: int = Field(10, ge=1)
    # How often a gateway renews its lease and, while its mirror shows no
    # leader, tries to win. Shorter: faster takeover after a clean stop, one
    # more keepalive per gateway each time.
    election_interval: float = Field(0.5, gt=0)
    # The three are checked together at start, as client-go checks its lease
    # duration, renew deadline and retry period: lease_ttl >= 3 x
    # election_interval (three renewals per lease) and, with etcd, lease_ttl
    # >= 2 x etcd_timeout (a renewal that hangs until its deadline leaves
    # time for another before the lease runs out).

    # --- this gateway ---------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8080
    # Unique per gateway; default derived from host name and port.
    gateway_id: str = ""
    # The URL others use to reach this gateway (agents, the cluster page).
    # Default: http://HOST:PORT, https with TLS on.
    public_url: str = ""
    # TLS on this gateway's port (docs/architecture.md, "TLS"): a PEM
    # certificate (chain) and its key, both or neither, checked at start.
    # Set: clients, `llmgw ctl` and agents must reach it over https and
    # verify it (their LLMGW_CA_FILE, or the system's CAs); nothing answers
    # in clear on this port. Costs a handshake per new connection (agents
    # and the router's clients keep theirs open) and the encryption's CPU.
    # Unset: plain HTTP, for a gateway behind a TLS-terminating proxy or on a
    # trusted network. Gateway -> engine and gateway -> agent API stay HTTP.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

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

    # --- load-based scaling (docs/architecture.md, Reconciler) ---------------------
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
    # Seconds an engine's queue must stay non-empty (or its KV cache full)
    # before the leader adds replicas for it whatever the load target. The
    # second replica comes this much (plus a poll, a snapshot and a pass:
    # 3 s at most with the defaults) after saturation. Shorter: replicas
    # for bursts an engine would have worked off alone (each reload of a
    # vLLM engine takes minutes, and the surplus stays a scale-down window);
    # longer: requests wait that much longer in a full engine.
    saturated_after: float = Field(5.0, gt=0, le=3600)

    # --- agents -----------------------------------------------------------------
    # A node whose agent has not heartbeated for this long is gone: its
    # inventory key expires with its lease and its replicas are re-placed.
    node_ttl: int = 15
    # Longest a long-poll for assignments is held open. Longer means fewer
    # idle requests; it must stay under any proxy's idle timeout.
    assignment_wait: float = 25.0
    # Run an agent inside `llmgw serve` (the all-in-one mode). Default: on
    # with the embedded store, off with etcd.
    local_agent: bool | None = None
    # Name of the in-process agent's node.
    local_node: str = ""
    # GPUs the in-process agent declares; unset: discovered with nvidia-smi.
    local_gpus: int | None = None
    # Seconds an engine may stay `starting` before its agent stops it and
    # counts a death (3 in 10 min leave it failed). Also read by `llmgw
    # agent`. Generous: large weights download and load slowly; shorter
    # kills slow but healthy loads, longer holds the GPUs of a hung one.
    engine_start_timeout: float = Field(1800.0, gt=0)

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
    # All-in-one mode: stop the in-process agent's engines when `llmgw serve`
    # stops. Off by default: they keep running and the next `llmgw serve` on
    # the same data_dir adopts them, so a restart reloads no model. On: a
    # stop frees the GPUs, and the next start loads every model again.
    stop_engines_on_exit: bool = False

    # --- router -------------------------------------------------------------------
    # The limits on one /v1 request's life (docs/architecture.md, "Routing").
    # Seconds to wait for an engine to accept a connection before trying
    # another replica. Longer: a dead node's replicas cost each request that
    # long; shorter: a busy engine's accept queue is taken for a dead one.
    connect_timeout: float = Field(5.0, gt=0)
    # One deadline per request, across all its attempts, until the last byte
    # of the answer (a plain answer comes whole only once generated, so this
    # bounds the longest plain generation). Shorter cuts long generations;
    # longer lets a wedged engine hold a client that long.
    request_timeout: float = Field(600.0, gt=0)
    # A stream's first body byte must come within this long of the request
    # reaching the engine: queueing, then the prefill of the whole prompt (a
    # 100k-token prompt on a busy GPU takes minutes). Longer: an engine
    # that hangs holds its clients longer before their 504; shorter: long
    # prompts fail under load. Not retried: the engine may still be working.
    first_byte_timeout: float = Field(300.0, gt=0)
    # After its first byte, a stream that sends nothing for this long ends
    # with an error event. Engines send a token every few tens of ms; vLLM
    # preempting a request under memory pressure pauses it for seconds.
    # Shorter cuts those pauses; longer holds a dead stream open longer.
    # The same limit drops a client that takes nothing for this long (its
    # socket full): it would hold the engine's connection, the replica's
    # in-flight count and its key's concurrency until the request timeout.
    stream_idle_timeout: float = Field(60.0, gt=0)
    # Stopping (docs/architecture.md, "Stopping"). After SIGTERM, /readyz
    # answers 503 and the gateway still accepts for this long, so that a
    # balancer's health check takes it out before it stops accepting: the
    # shipped haproxy.cfg's 2 failed checks 1 s apart, plus one check in
    # flight. Shorter than the balancer needs: requests it sends meanwhile
    # are refused (compose/haproxy.cfg resends them; others may not).
    # Longer: every stop takes that much longer.
    shutdown_notice_seconds: float = Field(3.0, ge=0)
    # Then it stops accepting and open requests and streams run to their
    # end for up to this long; what is left is cut (a stream with an error
    # event). At most LLMGW_REQUEST_TIMEOUT: no request runs longer anyway.
    # Shorter cuts long generations at each restart; longer holds a rolling
    # restart that long. The unit's TimeoutStopSec and compose's
    # stop_grace_period must exceed notice + grace.
    shutdown_grace_seconds: float = Field(600.0, ge=0)
    # Seconds a replica that failed a request (refused, 502/503, broke off,
    # stalled) is passed over while another replica of its model is left.
    # Longer spares clients a dead replica until the agent reports it (a few
    # seconds); shorter puts a recovered one back to work sooner. 0: off.
    replica_cooldown: float = Field(5.0, ge=0)
    # Prompt affinity: requests of one conversation (X-Session-Id,
    # prompt_cache_key, or the same opening messages) go to one replica while
    # its load stays within 1.25x the mean, so the engine reuses its prefix
    # cache. Off: power of two choices alone (measured in bench/affinity.py).
    router_affinity: bool = True
    # Base URL of an OTLP/HTTP collector (e.g. http://otel-collector:4318):
    # a span per /v1 request and per attempt is exported there (needs the
    # `otel` extra). Empty: no tracing, and OpenTelemetry is not even
    # imported. Set, it costs some 20-40 us of CPU per request (the spans;
    # export runs in the SDK's thread, in batches) and the collector's load.
    otlp_endpoint: str = ""
    # The garbage collector's generation-0 threshold once the gateway has
    # started (its start-up objects are then frozen out of collections). With
    # 256 requests in flight, CPython's default (700) ran a full collection
    # every 0.2 s, each walking the whole heap: 28% of the event loop's time,
    # pauses up to 115 ms (bench/RESULTS.md). 7000 (and freezing) cut that to
    # 6% and 2.4 ms, for a few MiB more garbage between collections. 0 leaves
    # CPython's defaults alone.
    gc_threshold: int = Field(7000, ge=0)
    # Scale from zero: a request for a model whose replica is on its way
    # (loading, or a min-0 model stopped while idle) is held this long, then
    # answered 503. Longer covers slower model loads (a 70B model can take
    # minutes); it must stay under request_timeout.
    cold_start_timeout: float = Field(300.0, gt=0)
    # Requests one gateway holds per starting model; more answer 503 with
    # Retry-After at once. Each held request is one open connection.
    cold_start_max_held: int = Field(64, ge=0)
    # Spill-over: a request for a model with an overflow (docs/architecture.md,
    # Catalog) waits this long for a replica on its way, then goes to the
    # overflow instead. Longer spends less of the keys' external budgets on
    # cold starts, at that much more latency for the requests that spill.
    spill_hold: float = Field(10.0, gt=0)

    # --- before a client is authenticated (docs/architecture.md, Security) -------
    # The largest body /admin (and any other non-/v1 route) and /agent/v1
    # accept, read only once the token is checked; more is a 413. Their bodies
    # are small (a model spec, a node's inventory with its GPUs, a status
    # report): larger caps let a token holder make a gateway hold more memory
    # per request; smaller ones refuse a fleet's larger reports. /v1's own cap
    # is 32 MiB (app/router/proxy.py).
    admin_max_body: int = Field(1024 * 1024, ge=1024)
    agent_max_body: int = Field(1024 * 1024, ge=1024)
    # Seconds a connection may take to send a request's headers (counted from
    # when it opens, or from its next request's first byte), and may go with
    # no byte in the middle of a body; then it is closed (app/slowclients.py).
    # Longer lets slow or hostile clients hold a descriptor each that long;
    # shorter cuts clients on very bad links.
    header_timeout: float = Field(30.0, gt=0)
    body_timeout: float = Field(30.0, gt=0)
    # Seconds a kept-open connection may sit idle between requests before it
    # is closed (uvicorn's timeout_keep_alive, whole seconds). Longer holds a
    # descriptor per idle client that long; shorter makes clients reconnect
    # more often. A balancer's pooled connections should idle out first.
    keep_alive_timeout: int = Field(5, ge=1)
    # Seconds after its headers arrived (this process's monotonic clock, which
    # runs on while the process is paused) past which an admin write is not
    # applied: 408, nothing written (docs/architecture.md, Catalog writes).
    # Longer lets a write held up (a paused gateway) land that much later,
    # over newer edits; shorter refuses writes on a slow store or link.
    admin_write_deadline: float = Field(30.0, gt=0)

    # --- the catalog ------------------------------------------------------------
    # Comma-separated folders a model given as a file path must lie under (on
    # the nodes; the gateway checks the path's shape, not its existence). A
    # path elsewhere is refused, so an admin token cannot point engines at
    # /etc or another tenant's weights. Add the folders your nodes keep
    # weights in; hub ids ("org/name") need none.
    model_roots: str = "/models,/var/lib/llmgw/models"
    # The folder (on every gateway host) an external model's api_key_file
    # must lie in (docs/architecture.md, Security, "Files an admin names").
    # Keep only provider keys there: an admin can have any file in it sent
    # to a URL of its choosing. Empty: no key files at all. Never data_dir.
    provider_key_dir: str = "/etc/llmgw/keys"
    # A catalog ({"models": {name: spec}}, YAML or JSON, the form
    # GET /admin/catalog exports) written to the store by the first gateway
    # to start while the store has no catalog; ignored once it has one (edit
    # it through /admin then). Checked at start: a bad file stops the gateway,
    # naming the model and field.
    catalog_file: Path | None = None
    # Seconds between republishes of the router's tables when nothing
    # changes: the backstop that picks up a rotated external provider key
    # (its api_key_file is reread each interval). Shorter: a rotated key is
    # used sooner, for a pass over the mirrored replicas each time.
    publish_interval: float = Field(10.0, gt=0)

    # The operator's own vLLM executable: used as it is, never installed over.
    # Empty: `vllm` on PATH, and only on nodes with GPUs.
    vllm_bin: str = ""
    # The vLLM version every node's engine build installs (`vllm==X`) unless
    # its conf names another (PUT /admin/nodes/{node}/engine-build). A change
    # makes each node install that version (minutes of downloads, GBs of
    # disk per version kept) before it takes new vLLM replicas.
    vllm_version: str = DEFAULT_VLLM_VERSION

    # --- client keys (docs/architecture.md, "Client keys") -------------------------
    # Seconds between this gateway's writes of client key usage (one
    # transaction per 64 keys in use, never one per request). Longer: fewer
    # store writes; GET /admin/keys/{id}/usage lags by up to this long, and a
    # crashed gateway loses up to this long of counts (a clean stop loses none).
    key_usage_interval: float = Field(5.0, gt=0)
    # Seconds between passes of the loop that moves each gateway's claims on
    # client keys' limits toward where their requests arrive (app/key_shares.py;
    # it also runs at once on a refusal below a key's limit). Its record is
    # written at most this often while only its load changes. Shorter: claims
    # follow a client sooner, for more store writes from busy gateways.
    key_share_interval: float = Field(0.5, gt=0)
    # A llama.cpp stream's prompt is counted by its engine after the stream
    # (app/router/counting.py): at most this many counts at once per
    # gateway, each waiting its turn behind the engine's requests for up to
    # the timeout, then estimated instead. More: each count waits less
    # behind the others, while a chat's count may cost its engine a prefill;
    # a longer timeout estimates fewer prompts of a busy engine.
    prompt_count_concurrency: int = Field(2, ge=1)
    prompt_count_timeout: float = Field(120.0, gt=0)

    # --- node operations (docs/architecture.md, "Node operations") ---------------------
    # Seconds a gateway waits for an agent's API (logs, cached weights) on an
    # admin's behalf, connecting included; then 504. Removing a large model's
    # files can take seconds; longer holds an admin request on a hung agent.
    node_api_timeout: float = Field(30.0, gt=0)
    # Seconds to connect to an agent's API; then 502 (unreachable).
    node_api_connect_timeout: float = Field(5.0, gt=0)
    # Seconds the gateway answering GET /admin/stats (the cluster page's
    # charts) waits for each other gateway's own figures; one that has not
    # answered is named in the answer and left out of the sums. Longer: a
    # hung gateway holds every chart poll (every 10 s) that long.
    stats_peer_timeout: float = Field(1.0, gt=0)

    # --- agent upgrades (docs/architecture.md, "Node operations") ----------------------
    # Seconds a gateway waits for an agent's installer on POST
    # /admin/nodes/{node}/upgrade; keep it above the agents'
    # LLMGW_AGENT_UPGRADE_TIMEOUT (300 s by default), else the gateway answers
    # 504 while the install may still succeed.
    node_upgrade_timeout: float = Field(330.0, gt=0)
    # The oldest agent version that gets new replicas (the newest: this
    # gateway's own; app/control/agentversion.py). Default: this gateway's
    # major.minor.0. Lower keeps older agents in use through a rolling
    # upgrade; agents outside keep their replicas but get no new ones.
    min_agent_version: str | None = None

    @field_validator("vllm_version")
    @classmethod
    def _vllm_version(cls, v: str) -> str:
        return check_vllm_version(v)

    @field_validator("min_agent_version")
    @classmethod
    def _a_version(cls, v: str | None) -> str | None:
        if v is not None:
            from app.wire.versions import parse

            parse(v)  # ValueError: "... is not a version"
        return v

    @field_validator("secret", "previous_secret", "admin_token")
    @classmethod
    def _refuse_placeholders(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            raw = v.get_secret_value()
            if raw.strip().lower() in _PLACEHOLDERS or len(raw) < 16:
                raise ValueError("must be at least 16 characters and not a placeholder")
        return v

    @field_validator("etcd_endpoints")
    @classmethod
    def _endpoints_shape(cls, v: str) -> str:
        # Checked here too (the store parses them again), so a typo stops
        # `llmgw serve` with one line naming the endpoint, not a traceback.
        from app.store.etcd_endpoints import parse_endpoints

        if parts := [part for part in v.split(",") if part.strip()]:
            parse_endpoints(parts)  # also refuses http and https mixed
        return v

    @field_validator("catalog_file")
    @classmethod
    def _catalog_file(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if v is not None:
            roots = _root_list(info.data.get("model_roots", ""))
            # Raises CatalogError (a ValueError) naming each field.
            load_file(v, roots, key_dir=info.data.get("provider_key_dir", ""))
        return v

    @field_validator("etcd_prefix")
    @classmethod
    def _prefix_shape(cls, v: str) -> str:
        return v if v.endswith("/") else v + "/"

    @model_validator(mode="after")
    def _derive(self) -> Settings:
        if self.uses_etcd and self.secret is None:
            raise ValueError("LLMGW_SECRET is required when LLMGW_ETCD_ENDPOINTS is set")
        if self.uses_etcd and self.admin_token is None:
            raise ValueError("LLMGW_ADMIN_TOKEN is required when LLMGW_ETCD_ENDPOINTS is set")
        if self.previous_secret is not None and self.secret is not None and (
                self.previous_secret.get_secret_value() == self.secret.get_secret_value()):
            raise ValueError("LLMGW_PREVIOUS_SECRET is LLMGW_SECRET: set it to the secret "
                             "being replaced, or unset it")
        self._check_timings()
        check_key_dir(self.provider_key_dir, self.data_dir,  # ValueError, one line
                      [v for _, v in self if isinstance(v, Path)])
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("LLMGW_TLS_CERT_FILE and LLMGW_TLS_KEY_FILE go together: "
                             "set both or neither")
        if self.tls_cert_file is not None and self.tls_key_file is not None:
            from app.tls import check_pair

            check_pair(self.tls_cert_file, self.tls_key_file)  # ValueError, one line
        from app.store.etcd_tls import for_endpoints

        # Reads and checks the etcd TLS files: ValueError, one line.
        for_endpoints(self.endpoints, self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file)
        if not self.gateway_id:
            self.gateway_id = f"{socket.gethostname()}-{self.port}"
        if not self.public_url:
            host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
            self.public_url = f"{self.scheme}://{host}:{self.port}"
        if self.local_agent is None:
            self.local_agent = not self.uses_etcd
        if not self.local_node:
            self.local_node = socket.gethostname()
        return self

    def _check_timings(self) -> None:
        """Durations that only work together (docs/architecture.md, Election)."""
        if self.lease_ttl < 3 * self.election_interval:
            raise ValueError(
                f"LLMGW_LEASE_TTL ({self.lease_ttl} s) must be at least 3 x "
                f"LLMGW_ELECTION_INTERVAL ({self.election_interval} s): a leader renews its "
                "lease every interval and must get several tries in before it expires")
        if self.uses_etcd and self.lease_ttl < 2 * self.etcd_timeout:
            raise ValueError(
                f"LLMGW_LEASE_TTL ({self.lease_ttl} s) must be at least 2 x "
                f"LLMGW_ETCD_TIMEOUT ({self.etcd_timeout} s): a renewal that hangs until "
                "its deadline must leave time for another before the lease expires")
        if self.drain_seconds <= self.request_timeout:
            raise ValueError(
                f"LLMGW_DRAIN_SECONDS ({self.drain_seconds} s) must exceed "
                f"LLMGW_REQUEST_TIMEOUT ({self.request_timeout} s): the drain cap must not "
                "cut a request the proxy would still let run")
        if self.shutdown_grace_seconds > self.request_timeout:
            raise ValueError(
                f"LLMGW_SHUTDOWN_GRACE_SECONDS ({self.shutdown_grace_seconds} s) must not exceed "
                f"LLMGW_REQUEST_TIMEOUT ({self.request_timeout} s): no request runs longer")

    @property
    def scheme(self) -> str:
        """What this gateway's port speaks."""
        return "https" if self.tls_cert_file is not None else "http"

    @property
    def uses_etcd(self) -> bool:
        return bool(self.endpoints)

    @property
    def model_root_list(self) -> list[str]:
        return _root_list(self.model_roots)

    @property
    def endpoints(self) -> list[str]:
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    def ensure_local_secrets(self) -> None:
        """Embedded mode: load or create the secret and admin token in data_dir.

        Files are created 0600 and their contents are never logged.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.secret is None:
            self.secret = SecretStr(_load_or_create(self.data_dir / "secret"))
        if self.admin_token is None:
            self.admin_token = SecretStr(_load_or_create(self.data_dir / "admin-token"))


def _root_list(roots: str) -> list[str]:
    return [r.strip().rstrip("/") or "/" for r in roots.split(",") if r.strip()]


def _load_or_create(path: Path) -> str:
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(value + "\n")
    return value
