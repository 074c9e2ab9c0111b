"""A gateway renews a node's lease once per third of its TTL, not on every
heartbeat, and writes a changed inventory at once (docs/design/scale.md).
In-process gateway on a real etcd."""

from __future__ import annotations

import asyncio
import itertools
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


async def test_a_gateways_own_lease_is_renewed_every_fifth_of_its_ttl(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    """A held lease at a fifth of its TTL (1 s here), not every election
    interval (0.5 s): each renewal costs an idle gateway 1.5-3 ms of CPU
    (docs/design/control-plane.md, "Election"). A lease lost is asked for
    again at the election interval, and leadership comes back with it."""
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1, lease_ttl=5,
                        etcd_timeout=2) as [(app, _)]:
        gw = app.state.gateway
        assert gw.settings.renew_interval == 1.0
        await until(lambda: gw.elector.is_leader, "leading")
        loop = asyncio.get_running_loop()
        renewals: list[float] = []
        keepalive = gw.store.keepalive

        async def counted(lease: int) -> int:
            renewals.append(loop.time())
            return await keepalive(lease)

        gw.store.keepalive = counted  # type: ignore[method-assign]
        await asyncio.sleep(4.5)
        gaps = [later - sooner for sooner, later in itertools.pairwise(renewals)]
        assert 3 <= len(renewals) <= 6 and all(0.8 < g < 1.5 for g in gaps), gaps
        # etcd ends the lease (as it would one expired): the next renewal
        # finds it gone, and a new one is granted an election interval later.
        lost = gw.elector.lease
        await gw.store.revoke(lost)
        await until(lambda: gw.elector.lease not in (0, lost) and gw.elector.is_leader,
                    "a new lease, leading again", 5.0)
