"""The node token: what an agent presents for its node, derived from the
shared secret (docs/design/security.md). Both ends compute it: the
gateways to check it, `llmgw ctl node-token` to hand it to an operator.
Engine keys and the secret's id stay with the control plane
(app/control/keys.py), which alone derives them.
"""

from __future__ import annotations

import hashlib
import hmac

_NODE_LABEL = b"llmgw node token\x00"


def node_token(secret: str, node: str) -> str:
    """The token an agent presents for node `node` (`llmgw ctl node-token`)."""
    mac = hmac.new(secret.encode(), _NODE_LABEL + node.encode(), hashlib.sha256)
    return "llmgw-node-" + mac.hexdigest()[:40]


def check_node_token(secret: str, node: str, presented: str) -> bool:
    return hmac.compare_digest(node_token(secret, node), presented)
