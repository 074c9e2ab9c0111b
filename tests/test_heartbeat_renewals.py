"""A gateway renews a node's lease once per third of its TTL, not on every
heartbeat, and writes a changed inventory at once (docs/design/scale.md).
In-process gateway on a real etcd."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.control import state as s
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import until
from tests.test_agent_api import _inventory, _join, _node, gateways


async def test_a_node_lease_is_renewed_once_per_third_of_its_ttl_not_per_heartbeat(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1, node_ttl=3) as [(a, c)]:
        gw = a.state.gateway
        await _join(c)
        await until(lambda: gw.mirror.get(s.NODES + "n1") is not None, "node mirrored")
        loop = asyncio.get_running_loop()
        joined = gw.mirror.get(s.NODES + "n1")
        assert joined is not None and joined.lease
        # Counts the renewals of the node's lease the gateway asks of etcd
        # (each still made; the gateway's own leases renew through it too).
        renewals: list[int] = []
        keepalive = gw.store.keepalive

        async def counted(lease: int) -> int:
            if lease == joined.lease:
                renewals.append(lease)
            return await keepalive(lease)

        gw.store.keepalive = counted  # type: ignore[method-assign]
        beats = 0
        end = loop.time() + 4.5  # half as long again as the TTL
        while loop.time() < end:
            r = await c.put("/agent/v1/nodes/n1", json=_inventory("n1"), headers=_node("n1"))
            assert r.status_code == 200, r.text
            assert r.json()["ttl"] == 3
            beats += 1
            await asyncio.sleep(0.1)
        assert beats >= 20
        # One renewal a second (TTL / 3), not one per heartbeat...
        assert 3 <= len(renewals) <= 7, (len(renewals), beats)
        # ... and those keep the node: its key outlived the TTL.
        held = await gw.store.get(s.NODES + "n1")
        assert held is not None and held.lease == joined.lease
        # A changed inventory is written at once, renewal due or not.
        r = await c.put("/agent/v1/nodes/n1", json=_inventory("n1", address="127.0.0.2"),
                        headers=_node("n1"))
        assert r.status_code == 200, r.text
        written = await gw.store.get(s.NODES + "n1")
        assert written is not None
        assert s.NodeInfo.model_validate_json(written.value).address == "127.0.0.2"
