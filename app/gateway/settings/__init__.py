"""Every setting of a gateway, with its default and what changing it costs.

Read from the environment with the prefix `LLMGW_` (e.g. `LLMGW_LEASE_TTL`).
`Settings` is built once by the caller (the CLI or a test) and passed down
to the composition root (app/gateway/assembly.py): nothing reads the
environment at import time, so one process can hold several differently
configured gateways.

The settings are grouped by the part of the gateway that reads them, one
class per module of this package. `Settings` (here) is all of them at once,
and checks here what spans groups; a new setting goes in the group of what
reads it, with a comment saying what changing it costs.

- `store`: the store: etcd (members, TLS, prefix, deadline, compaction) or the embedded one's folder
- `trust`: the shared secret, the previous one during a rotation, the admin token
- `control`: the control plane: the lease, reconcile passes, drains, usage snapshots, scaling
- `edge`: the HTTP server: address, TLS, body caps, slow clients, how it stops
- `router`: a /v1 request's time limits, replica choice, scale from zero's held requests
- `tracing`: what the gateway tells an operator's collectors (OTLP)
- `catalog`: model roots, provider key files, the seed catalog file, publish interval
- `nodes`: the agents as the gateway sees them: heartbeats, vLLM version, node API calls
- `local_agent`: the all-in-one mode's agent, run in the gateway's process
- `_group`: the base of every group: the `LLMGW_` prefix, unknown variables ignored
"""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import SecretStr, model_validator

from app.control.keyfiles import check_key_dir
from app.gateway.settings._group import CONFIG
from app.gateway.settings.catalog import CatalogSettings
from app.gateway.settings.control import ControlSettings
from app.gateway.settings.edge import EdgeSettings
from app.gateway.settings.local_agent import LocalAgentSettings
from app.gateway.settings.nodes import NodeSettings
from app.gateway.settings.router import RouterSettings
from app.gateway.settings.store import StoreSettings
from app.gateway.settings.tracing import TracingSettings
from app.gateway.settings.trust import TrustSettings, load_or_create

__all__ = ["Settings"]


# Pydantic orders the fields from the last base to the first: the store's
# come first, the local agent's last. That order is the one validation errors
# are listed in, and a field validator sees (info.data) only fields before
# its own.
class Settings(
    LocalAgentSettings,
    NodeSettings,
    CatalogSettings,
    TracingSettings,
    RouterSettings,
    EdgeSettings,
    ControlSettings,
    TrustSettings,
    StoreSettings,
):
    model_config = CONFIG

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
        from app.store.etcd.tls import for_endpoints

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
        """Durations that only work together (docs/design/control-plane.md, "Election")."""
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

    def ensure_local_secrets(self) -> None:
        """Embedded mode: load or create the secret and admin token in data_dir.

        Files are created 0600 and their contents are never logged.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.secret is None:
            self.secret = SecretStr(load_or_create(self.data_dir / "secret"))
        if self.admin_token is None:
            self.admin_token = SecretStr(load_or_create(self.data_dir / "admin-token"))
