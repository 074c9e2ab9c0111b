"""Keys derived from the shared secret, and client key hashing.

Engine keys and node tokens (app/wire/tokens.py) are *derived*, never stored: every gateway that
knows LLMGW_SECRET computes the same value, so a replica adopted after a
restart, or reached through another gateway, needs no table, and etcd holds
nothing that opens an engine. A key taken from one node opens that replica
only, since each is bound to its replica id.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from app.wire.tokens import check_node_token, node_token

_ENGINE_LABEL = b"llmgw engine key\x00"
_ID_LABEL = b"llmgw secret id"


def engine_key(secret: str, replica_id: str) -> str:
    """The API key replica `replica_id`'s engine demands (DESIGN invariant 4)."""
    mac = hmac.new(secret.encode(), _ENGINE_LABEL + replica_id.encode(), hashlib.sha256)
    return "llmgw-" + mac.hexdigest()[:40]


def secret_id(secret: str) -> str:
    """A short, non-secret name of `secret` (8 hex digits of an HMAC): what a
    replica records as the secret its engine key derives from, and what a
    gateway advertises as its own. It opens nothing, but it does let anyone
    who reads etcd test guesses of the secret, hence the settings' minimum
    length (docs/design/security-operations.md, "Rotating the shared secret")."""
    return hmac.new(secret.encode(), _ID_LABEL, hashlib.sha256).hexdigest()[:8]


def replica_secret_id(recorded: str, current_id: str, previous_id: str | None) -> str:
    """The id of the secret a replica's engine key derives from.

    A replica records it (`Replica.secret`); one written before replicas did
    ("") was placed under the secret of its time: the previous one while a
    rotation is under way (a previous secret is configured), else the
    current one, so upgrading to this code rolls no replica."""
    return recorded or previous_id or current_id


@dataclass(frozen=True)
class SecretRing:
    """The shared secret and, during a rotation, the previous one
    (LLMGW_PREVIOUS_SECRET): every derivation a gateway makes goes through
    here, so a rotation loses no node and no engine
    (docs/design/security-operations.md, "Rotating the shared secret")."""

    current: str = field(repr=False)
    previous: str | None = field(default=None, repr=False)

    @cached_property
    def current_id(self) -> str:
        return secret_id(self.current)

    @cached_property
    def previous_id(self) -> str | None:
        return secret_id(self.previous) if self.previous is not None else None

    def replica_secret_id(self, recorded: str) -> str:
        return replica_secret_id(recorded, self.current_id, self.previous_id)

    def _deriving(self, recorded: str) -> str:
        """The secret a replica's engine key is derived from: the previous
        one while it is configured and the replica is of it; else the
        current one (a replica of an unknown secret gets the current key,
        which its engine refuses: the agent reports that, and the leader
        replaces the replica, see `fleet_secret_id`)."""
        if self.previous is not None and self.replica_secret_id(recorded) == self.previous_id:
            return self.previous
        return self.current

    def engine_key(self, replica_id: str, recorded: str) -> str:
        """The key of a replica whose record names secret id `recorded`."""
        return engine_key(self._deriving(recorded), replica_id)

    def key_secret_id(self, recorded: str) -> str:
        """The id of the secret `engine_key` derives from for such a replica."""
        return secret_id(self._deriving(recorded))

    def engine_keys(self, replica_id: str) -> list[str]:
        """Every key the replica could have: what log masking hides."""
        return [engine_key(s, replica_id) for s in (self.current, self.previous) if s]

    def check_node_token(self, node: str, presented: str
                         ) -> Literal["current", "previous"] | None:
        """Which secret `presented` is node `node`'s token of, if either."""
        if check_node_token(self.current, node, presented):
            return "current"
        if self.previous is not None and check_node_token(self.previous, node, presented):
            return "previous"
        return None

    def node_tokens(self, node: str) -> list[str]:
        """The tokens a gateway may present to node `node`'s agent, in order."""
        return [node_token(s, node) for s in (self.current, self.previous) if s]

    def fleet_secret_id(self, gateway_ids: Iterable[str]) -> str:
        """The secret id the leader places new replicas under and holds every
        replica to: the current one once every live gateway (`gateway_ids`,
        as each advertises its own current id, "" for a gateway older than
        this) says it is current; until then the previous one, which those
        gateways still derive with, so no router and no agent is handed a
        key its engine refuses. Without a previous secret, the current one:
        there is nothing else this gateway can derive."""
        if self.previous is None:
            return self.current_id
        ids = set(gateway_ids)
        return self.current_id if ids <= {self.current_id} else str(self.previous_id)


def new_client_key() -> str:
    """A fresh client API key. Shown once; only its hash is kept."""
    return "sk-llmgw-" + secrets.token_urlsafe(32)


def hash_client_key(key: str) -> str:
    """sha256 hex: the name a client key is stored and looked up under.

    A plain (unsalted) hash is enough: keys are 256 random bits, so there is
    no dictionary to attack, and the router must look a key up in O(1).
    """
    return hashlib.sha256(key.encode()).hexdigest()
