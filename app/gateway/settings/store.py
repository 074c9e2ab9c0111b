"""The store's settings: etcd (its members, TLS, prefix, deadline,
compaction) or the embedded store's folder. Read by app/store and the
gateway that opens it."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from app.gateway.settings._group import Group


class StoreSettings(Group):
    # --- where the shared state lives -------------------------------------
    # Comma-separated host:port of etcd members, or https://host:port (all of
    # them) for TLS, docs/design/tls.md. Empty: the embedded store in
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
    # revision it saw one interval earlier
    # (docs/design/security-operations.md, "A month of uptime");
    # 0 turns it off (then etcd's own --auto-compaction-* must, or
    # its space quota fills and the fleet turns read-only). Longer: more
    # history kept (etcd's database grows with writes per interval), and
    # watches lagging up to that long replay rather than resync; shorter:
    # a smaller database, and a watch lagging over one interval resyncs.
    etcd_compaction_interval: float = Field(300.0, ge=0)
    # The embedded store, the generated secret and admin token live here.
    data_dir: Path = Field(default_factory=lambda: Path.home() / ".local/share/llmgw")

    @field_validator("etcd_endpoints")
    @classmethod
    def _endpoints_shape(cls, v: str) -> str:
        # Checked here too (the store parses them again), so a typo stops
        # `llmgw serve` with one line naming the endpoint, not a traceback.
        from app.store.etcd.endpoints import parse_endpoints

        if parts := [part for part in v.split(",") if part.strip()]:
            parse_endpoints(parts)  # also refuses http and https mixed
        return v

    @field_validator("etcd_prefix")
    @classmethod
    def _prefix_shape(cls, v: str) -> str:
        return v if v.endswith("/") else v + "/"

    @property
    def uses_etcd(self) -> bool:
        return bool(self.endpoints)

    @property
    def endpoints(self) -> list[str]:
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]
