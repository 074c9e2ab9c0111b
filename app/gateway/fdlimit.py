"""The gateway's limit on open files, raised to what the system allows.

A gateway holds a socket per client connection, per engine connection and,
for the engine-load poll, per node agent it keeps a connection to (10,000
at 10,000 nodes: app/router/engine_load.py). The soft limit most systems
start a process with is 1,024, which such a fleet passes long before its
hard limit (often 524,288 or more): past it, accept() and connect() fail
with EMFILE. So `llmgw serve` raises the soft limit to the hard one at
start, as Go's runtime and nginx's `worker_rlimit_nofile` do; the hard
limit stays the operator's to set (docs/design/scale.md).
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)

# The most asked for when the hard limit is unlimited: more open files
# than a gateway has a use for, and some kernels refuse RLIM_INFINITY.
CEILING = 1 << 20


def raise_soft() -> tuple[int, int]:
    """Raises the soft limit on open files to the hard one (or CEILING);
    returns (before, after). Never lowers it; a refusal is logged and the
    limit kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = CEILING if hard == resource.RLIM_INFINITY else min(hard, CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            logger.warning("open files: the soft limit stays %d (raising it to %d was "
                           "refused: %s)", soft, want, exc)
            return soft, soft
        logger.info("open files: soft limit raised from %d to %d", soft, want)
        return soft, want
    return soft, soft
