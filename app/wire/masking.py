"""Secrets masked out of text that leaves a process: an agent's log lines,
and again at the gateway that relays them (DESIGN invariant 6). Used by the
agent (app/agent/logfiles.py) and the admin API (app/api/nodes.py); imports
nothing else of llmgw.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Engine keys and node tokens (app/control/keys.py) and client keys, by
# shape: a line naming a key of a replica this agent no longer knows (an
# old log generation) is masked too.
_SECRETS = re.compile(r"llmgw-(?:node-)?[0-9a-f]{40}|sk-llmgw-[A-Za-z0-9_-]{20,}")
MASK = "***"


def mask(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every known secret and every key-shaped string replaced."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return _SECRETS.sub(MASK, text)
