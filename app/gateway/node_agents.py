"""Each replica's node agent, for the router's engine load poll
(app/router/engine_load.py's `NodeDirectory`): the wiring between the
mirror and the router, which never imports the control plane."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from app.api.agent import check_engine_url
from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.router.engine_load import NodeAgent


class NodeAgents:
    """Read from the mirror at each poll (once a second). The node token
    goes only to an `api_url` on the node's own address (the check node
    operations make, app/api/nodes.py); a node without one has its engines
    read one by one.

    The answer is kept while the mirror's nodes and replicas views are the
    same ones, and each node's agent while its record is the same object:
    its tokens (an HMAC each) are derived once per change of the node, not
    per node per poll (10,000 nodes: 20,000 replicas walked and 10,000
    tokens derived every second on the event loop; docs/design/scale.md).
    The ring is the gateway's for its whole life."""

    def __init__(self, mirror: Mirror, secrets: SecretRing) -> None:
        self._mirror = mirror
        self._secrets = secrets
        self._of: tuple[object, object] = (None, None)
        self._answer: Mapping[str, NodeAgent] = MappingProxyType({})
        self._by_node: dict[str, tuple[s.NodeInfo, NodeAgent]] = {}

    def agents(self) -> Mapping[str, NodeAgent]:
        nodes, replicas = self._mirror.nodes(), self._mirror.replicas()
        if self._of[0] is nodes and self._of[1] is replicas:
            return self._answer
        known = self._by_node
        by_node: dict[str, tuple[s.NodeInfo, NodeAgent]] = {}
        out: dict[str, NodeAgent] = {}
        for rid, rep in replicas.items():
            seen = by_node.get(rep.node)
            if seen is None:
                info = nodes.get(rep.node)
                if info is None:
                    continue
                seen = known.get(rep.node)
                if seen is None or seen[0] is not info:
                    seen = (info, self._agent(rep.node, info))
                by_node[rep.node] = seen
            out[rid] = seen[1]
        self._by_node, self._of = by_node, (nodes, replicas)
        self._answer = MappingProxyType(out)
        return self._answer

    def _agent(self, node: str, info: s.NodeInfo) -> NodeAgent:
        usable = bool(info.api_url) and check_engine_url(info.api_url, info) is None
        return NodeAgent(node, info.api_url.rstrip("/") if usable else "",
                         tuple(self._secrets.node_tokens(node)) if usable else ())
