"""The gateway's HTTP server: where it listens and how others reach it, its
TLS, what a connection and a request meet before a client is authenticated
(body caps, slow clients, the admin write deadline), how it stops, and its
process's garbage collector. Read by app/cli.py (uvicorn), app/gateway/assembly.py and
app/gateway/http1.py."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from app.gateway.settings._group import Group


class EdgeSettings(Group):
    # --- this gateway ---------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8080
    # Unique per gateway; default derived from host name and port.
    gateway_id: str = ""
    # The URL others use to reach this gateway (agents, the cluster page).
    # Default: http://HOST:PORT, https with TLS on.
    public_url: str = ""
    # TLS on this gateway's port (docs/design/tls.md): a PEM
    # certificate (chain) and its key, both or neither, checked at start.
    # Set: clients, `llmgw ctl` and agents must reach it over https and
    # verify it (their LLMGW_CA_FILE, or the system's CAs); nothing answers
    # in clear on this port. Costs a handshake per new connection (agents
    # and the router's clients keep theirs open) and the encryption's CPU.
    # Unset: plain HTTP, for a gateway behind a TLS-terminating proxy or on a
    # trusted network. Gateway -> engine and gateway -> agent API stay HTTP.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Processes serving this gateway's port (`llmgw serve --workers N`;
    # docs/design/workers.md): each a full router with its own
    # mirror, lease and key shares. Unset: the cores this process may run on
    # with etcd, 1 on the embedded store (which one process owns; more is
    # refused). More: requests per second up to about N cores' worth, for N
    # mirrors' memory, N leases' keepalives and N key-share records in etcd,
    # and a client's limits shared by N more claimants (L + N - 1).
    workers: int | None = Field(None, ge=1, le=256)

    # --- stopping (docs/design/stopping.md) ------------------------------
    # After SIGTERM, /readyz answers 503 and the gateway still accepts for
    # this long, so that a balancer's health check takes it out before it
    # stops accepting: the shipped haproxy.cfg's 2 failed checks 1 s apart,
    # plus one check in flight. Shorter than the balancer needs: requests it sends meanwhile
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

    # --- the process ----------------------------------------------------------------
    # The garbage collector's generation-0 threshold once the gateway has
    # started (its start-up objects are then frozen out of collections). With
    # 256 requests in flight, CPython's default (700) ran a full collection
    # every 0.2 s, each walking the whole heap: 28% of the event loop's time,
    # pauses up to 115 ms (bench/RESULTS.md). 7000 (and freezing) cut that to
    # 6% and 2.4 ms, for a few MiB more garbage between collections. The
    # mirror's first load is frozen too, and what each full collection keeps
    # (app/gateway/gc_keeper.py), and the next two thresholds are 1 and 60
    # (`gc_keeper.thresholds`: shorter middle collections while thousands of
    # streams start). 0 leaves CPython's defaults alone: nothing frozen,
    # nothing kept.
    gc_threshold: int = Field(7000, ge=0)

    # --- before a client is authenticated (docs/design/security.md) -------
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
    # no byte in the middle of a body; then it is closed (app/gateway/http1.py).
    # Longer lets slow or hostile clients hold a descriptor each that long;
    # shorter cuts clients on very bad links.
    header_timeout: float = Field(30.0, gt=0)
    body_timeout: float = Field(30.0, gt=0)
    # Seconds a kept-open connection may sit idle between requests before it
    # is closed (uvicorn's timeout_keep_alive, whole seconds). Longer holds a
    # descriptor per idle client that long; shorter makes clients reconnect
    # more often. Clients' pooled connections must idle out first: at 5 s,
    # the openai SDK's own expiry (httpx's), a request sent on a connection
    # the gateway was closing that instant failed "Server disconnected
    # without sending a response" (the chaos suite, retries off: 1 in 100
    # schedules). 75 s outlasts it, aiohttp's 15 s and balancers' 60 s.
    keep_alive_timeout: int = Field(75, ge=1)
    # Seconds after its headers arrived (this process's monotonic clock, which
    # runs on while the process is paused) past which an admin write is not
    # applied: 408, nothing written (docs/design/admin-writes.md, "Catalog writes").
    # Longer lets a write held up (a paused gateway) land that much later,
    # over newer edits; shorter refuses writes on a slow store or link.
    admin_write_deadline: float = Field(30.0, gt=0)

    @property
    def scheme(self) -> str:
        """What this gateway's port speaks."""
        return "https" if self.tls_cert_file is not None else "http"
