"""The secrets every gateway holds (docs/design/security.md, "Trust boundaries and tokens"):
the shared secret engine keys and node tokens are
derived from, the one it replaces during a rotation, and the admin token.
Read by the control plane's keys, the admin API's auth and the agent API."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import SecretStr, field_validator

from app.gateway.settings._group import Group

# Values a careless copy of an example file would leave in place.
_PLACEHOLDERS = {"changeme", "change-me", "secret", "changethis", "password", "xxx"}


class TrustSettings(Group):
    # --- secrets ------------------------------------------------------------
    # Engine keys and node tokens are derived from it (HMAC). Required with
    # etcd, where every gateway must derive the same keys; generated and kept
    # in data_dir for the embedded store.
    secret: SecretStr | None = None
    # During a rotation of `secret`, the secret it replaces: gateways still
    # accept agents' node tokens of it and derive the engine keys of
    # replicas placed under it, until the leader has replaced them all.
    # Unset it once that is done and every agent has its new token (the
    # procedure: docs/design/security-operations.md, "Rotating the shared secret");
    # while set, a node token taken before the rotation still opens.
    previous_secret: SecretStr | None = None
    # Bearer token for /admin. Unset: generated into data_dir/admin-token.
    admin_token: SecretStr | None = None

    @field_validator("secret", "previous_secret", "admin_token")
    @classmethod
    def _refuse_placeholders(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            raw = v.get_secret_value()
            if raw.strip().lower() in _PLACEHOLDERS or len(raw) < 16:
                raise ValueError("must be at least 16 characters and not a placeholder")
        return v


def load_or_create(path: Path) -> str:
    """The secret kept in `path`, or a new one written there (0600)."""
    if path.exists():
        return path.read_text().strip()
    value = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(value + "\n")
    return value
