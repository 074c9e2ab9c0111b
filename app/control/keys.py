"""Keys derived from the shared secret, and client key hashing.

Engine keys and node tokens are *derived*, never stored: every gateway that
knows LLMGW_SECRET computes the same value, so a replica adopted after a
restart, or reached through another gateway, needs no table, and etcd holds
nothing that opens an engine. A key taken from one node opens that replica
only, since each is bound to its replica id.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

_ENGINE_LABEL = b"llmgw engine key\x00"
_NODE_LABEL = b"llmgw node token\x00"


def engine_key(secret: str, replica_id: str) -> str:
    """The API key replica `replica_id`'s engine demands (DESIGN invariant 4)."""
    mac = hmac.new(secret.encode(), _ENGINE_LABEL + replica_id.encode(), hashlib.sha256)
    return "llmgw-" + mac.hexdigest()[:40]


def node_token(secret: str, node: str) -> str:
    """The token an agent presents for node `node` (`llmgw ctl node-token`)."""
    mac = hmac.new(secret.encode(), _NODE_LABEL + node.encode(), hashlib.sha256)
    return "llmgw-node-" + mac.hexdigest()[:40]


def check_node_token(secret: str, node: str, presented: str) -> bool:
    return hmac.compare_digest(node_token(secret, node), presented)


def new_client_key() -> str:
    """A fresh client API key. Shown once; only its hash is kept."""
    return "sk-llmgw-" + secrets.token_urlsafe(32)


def hash_client_key(key: str) -> str:
    """sha256 hex: the name a client key is stored and looked up under.

    A plain (unsalted) hash is enough: keys are 256 random bits, so there is
    no dictionary to attack, and the router must look a key up in O(1).
    """
    return hashlib.sha256(key.encode()).hexdigest()
