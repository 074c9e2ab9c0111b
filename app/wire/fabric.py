"""The fabric test's contract between a gateway and the agents it measures
(docs/design/node-operations.md, "Fabric test"): where an agent's sink listens and the most
a test may ask of it. The agent enforces these (app/agent/fabric.py); the
admin API refuses a request past them before any traffic (app/api/fabric.py).
Both ends use this module; it imports nothing else of llmgw.
"""

from __future__ import annotations

SINK_PATH = "/node/v1/fabric/sink"
MAX_SECONDS = 2.0  # seconds of sending per direction, at most
MAX_BYTES = 1 << 30  # bytes per direction, at most
