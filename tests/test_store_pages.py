"""`EtcdStore.range` reads in pages (etcd's `limit`), on a real etcd.

One unbounded Range answers in one gRPC message, which the client caps at
4 MiB: a large fleet's state would not load. The pages must still make one
consistent snapshot, at the first page's revision (docs/design/scale.md),
whatever is written between them.
"""

from __future__ import annotations

from app.store.etcd.channel import Services
from app.store.etcd.store import EtcdStore
from tests.support.etcd import EtcdServer, ExternalEtcd


class CountingStore(EtcdStore):
    """Counts the calls (one per page) and runs `between` before the second."""

    def __init__(self, *args: object, between: EtcdStore | None = None, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.calls = 0
        self._between = between

    async def _services(self) -> Services:
        self.calls += 1
        if self.calls == 2 and self._between is not None:
            # A write lands between the first page and the second.
            await self._between.put("p/00", b"changed")
            await self._between.put("p/99", b"new")
        return await super()._services()


async def test_a_range_over_several_pages_reads_every_key_in_order(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    writer = await EtcdStore.open([etcd_server.endpoint], etcd_prefix)
    reader = CountingStore([etcd_server.endpoint], etcd_prefix, page_size=3)
    await reader.connect()
    try:
        for i in range(10):
            await writer.put(f"p/{i:02d}", f"v{i}".encode())
        await writer.put("p0", b"beside the prefix")
        last = await writer.put("q/1", b"outside")
        result = await reader.range("p/")
        assert [kv.key for kv in result.kvs] == [f"p/{i:02d}" for i in range(10)]
        assert [kv.value for kv in result.kvs] == [f"v{i}".encode() for i in range(10)]
        assert result.revision == last
        assert reader.calls == 4  # 3 + 3 + 3 + 1 keys
        everything = await reader.range("")
        assert len(everything.kvs) == 12
    finally:
        await reader.close()
        await writer.close()


async def test_pages_are_one_snapshot_at_the_first_pages_revision(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    writer = await EtcdStore.open([etcd_server.endpoint], etcd_prefix)
    reader = CountingStore([etcd_server.endpoint], etcd_prefix, page_size=2, between=writer)
    await reader.connect()
    try:
        for i in range(5):
            last = await writer.put(f"p/{i:02d}", f"v{i}".encode())
        result = await reader.range("p/")
        assert reader.calls > 1
        assert result.revision == last
        # Neither the change to p/00 (on a page already read) nor p/99 (on
        # a page read after it) shows: the whole answer is at `last`.
        assert {kv.key: kv.value for kv in result.kvs} == {
            f"p/{i:02d}": f"v{i}".encode() for i in range(5)}
        assert (await writer.get("p/99")) is not None
    finally:
        await reader.close()
        await writer.close()


def test_a_page_size_below_one_is_refused() -> None:
    try:
        EtcdStore(["127.0.0.1:2379"], "/x/", page_size=0)
    except ValueError as exc:
        assert "page_size" in str(exc)
    else:
        raise AssertionError("page_size=0 was accepted")
