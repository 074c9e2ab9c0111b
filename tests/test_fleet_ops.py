"""Fleet writes (app/control/ops/node_ops.py): node confs and quotas,
in-process against the embedded store and a running mirror: no HTTP."""

from __future__ import annotations

import time

import pytest

from app.control import state as s
from app.control.mirror import Mirror
from app.control.ops.base import Parts
from app.control.ops.conditions import NO_PRECONDITION, Deadline, Precondition, no_deadline
from app.control.ops.node_ops import FleetOps
from app.control.ops.refusals import Busy, NotFound, PreconditionFailed, TooLate
from app.store.base import TxnResult
from app.store.embedded import EmbeddedStore


def cordon(c: s.NodeConf) -> s.NodeConf:
    return c.model_copy(update={"cordoned": True})


async def test_an_unknown_node_is_not_found_and_gets_no_conf(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = FleetOps(Parts(store, mirror))
    with pytest.raises(NotFound) as missing:
        await ops.change_conf("ghost", cordon, NO_PRECONDITION, no_deadline())
    assert missing.value.what == "node"
    assert await store.get(s.NODECONF + "ghost") is None


async def test_a_conf_edit_keeps_the_rest_of_the_stored_conf(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    rev = await store.put(s.NODES + "n1", s.NodeInfo(name="n1").model_dump_json().encode())
    await mirror.wait_for(rev, 2.0)
    ops = FleetOps(Parts(store, mirror))
    await ops.change_conf("n1", lambda c: c.model_copy(update={"pool": "big"}),
                          NO_PRECONDITION, no_deadline())
    await ops.change_conf("n1", cordon, NO_PRECONDITION, no_deadline())
    conf = mirror.one(s.NODECONF + "n1", s.NodeConf)  # settled: read-your-writes
    assert conf is not None and conf.pool == "big" and conf.cordoned
    # The same conf again writes nothing.
    before = await store.get(s.NODECONF + "n1")
    await ops.change_conf("n1", cordon, NO_PRECONDITION, no_deadline())
    after = await store.get(s.NODECONF + "n1")
    assert before is not None and after is not None
    assert before.mod_revision == after.mod_revision


async def test_an_unreadable_conf_is_replaced(parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    rev = await store.put(s.NODECONF + "n1", b"{not json")
    await mirror.wait_for(rev, 2.0)
    ops = FleetOps(Parts(store, mirror))
    await ops.change_conf("n1", cordon, NO_PRECONDITION, no_deadline())
    kv = await store.get(s.NODECONF + "n1")
    assert kv is not None and s.NodeConf.model_validate_json(kv.value).cordoned


async def test_quotas_set_conditioned_and_deleted(parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = FleetOps(Parts(store, mirror))
    await ops.set_quota("team", 4, Precondition(if_none_match=("*",)), no_deadline())
    assert mirror.quotas()["team"].max_gpus == 4
    with pytest.raises(PreconditionFailed) as exists:
        await ops.set_quota("team", 8, Precondition(if_none_match=("*",)), no_deadline())
    kv = await store.get(s.QUOTAS + "team")
    assert kv is not None and exists.value.current == f'"{kv.mod_revision}"'
    await ops.set_quota("team", 8, Precondition(if_match=(f'"{kv.mod_revision}"',)),
                        no_deadline())
    assert mirror.quotas()["team"].max_gpus == 8
    await ops.delete_quota("team", NO_PRECONDITION, no_deadline())
    assert "team" not in mirror.quotas()
    with pytest.raises(NotFound) as missing:
        await ops.delete_quota("team", NO_PRECONDITION, no_deadline())
    assert missing.value.what == "quota"


async def test_nothing_is_written_past_the_deadline(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = FleetOps(Parts(store, mirror))
    with pytest.raises(TooLate):
        await ops.set_quota("team", 4, NO_PRECONDITION,
                            Deadline(received=time.monotonic() - 10, bound=1.0))
    assert await store.get(s.QUOTAS + "team") is None


async def test_a_record_that_never_settles_is_busy(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = FleetOps(Parts(store, mirror))
    real_txn = store.txn
    n = 0

    async def racing_txn(*args: object, **kwargs: object) -> TxnResult:
        # Another gateway's write lands between each decision and its write.
        nonlocal n
        n += 1
        await store.put(s.QUOTAS + "team", s.Quota(max_gpus=n).model_dump_json().encode())
        return await real_txn(*args, **kwargs)  # type: ignore[arg-type]

    store.txn = racing_txn  # type: ignore[method-assign]
    with pytest.raises(Busy, match="kept changing"):
        await ops.set_quota("team", 100, NO_PRECONDITION, no_deadline())
    store.txn = real_txn  # type: ignore[method-assign]
    assert n == 5 and mirror.quotas()["team"].max_gpus == 5


async def test_fabric_results_are_kept_per_direction(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = FleetOps(Parts(store, mirror))
    results = [s.FabricResult.model_validate({"from": a, "to": b, "gbps": 9.5, "bytes": 10,
                                              "seconds": 1.0, "at": 1.0})
               for a, b in (("n1", "n2"), ("n2", "n1"))]
    assert await ops.save_fabric(results, 2.0)
    assert sorted(kv.key for kv in mirror.items(s.FABRIC)) == [
        s.FABRIC + "n1/n2", s.FABRIC + "n2/n1"]
    await store.close()  # the store no longer answers: measured, not saved
    assert not await ops.save_fabric(results, 2.0)
