"""The catalog's write operations (app/control/ops/catalog_ops.py), driven
in-process against the embedded store and a running mirror: no HTTP."""

from __future__ import annotations

import json
import time

import pytest

from app.control import state as s
from app.control.mirror import Mirror
from app.control.ops.base import Parts
from app.control.ops.catalog_ops import CatalogOps
from app.control.ops.conditions import NO_PRECONDITION, Deadline, Precondition, no_deadline
from app.control.ops.refusals import Busy, NotFound, PreconditionFailed, Taken, TooLate
from app.store.embedded import EmbeddedStore


def spec(*aliases: str) -> s.ModelSpec:
    return s.ModelSpec.model_validate({"model": "org/m", "gpus": 1, "aliases": list(aliases)})


async def test_put_creates_then_replaces_and_the_mirror_has_it(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = CatalogOps(Parts(store, mirror), "gw-a")
    made = await ops.put_model("m", spec("a1"), NO_PRECONDITION, no_deadline())
    assert not made.existed and made.stored["name"] == "m"
    assert mirror.models()["m"].aliases == ["a1"]  # settled: read-your-writes
    kv = await store.get(s.MODELS + "m")
    assert kv is not None and made.etag == f'"{kv.mod_revision}"'
    again = await ops.put_model("m", spec(), NO_PRECONDITION, no_deadline())
    assert again.existed and again.stored["created"] == made.stored["created"]
    assert again.etag != made.etag
    serial = await store.get(s.CATALOG_SERIAL)
    assert serial is not None and json.loads(serial.value) == {"by": "gw-a"}


async def test_an_alias_held_by_another_model_is_taken(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = CatalogOps(Parts(store, mirror), "gw-a")
    await ops.put_model("m", spec("shared"), NO_PRECONDITION, no_deadline())
    with pytest.raises(Taken, match="'shared' already names model 'm'"):
        await ops.put_model("n", spec("shared"), NO_PRECONDITION, no_deadline())
    with pytest.raises(Taken, match="'m' already names model 'm'"):
        await ops.put_model("n", spec("m"), NO_PRECONDITION, no_deadline())
    assert "n" not in mirror.models()


async def test_if_match_is_checked_against_the_record_as_stored(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = CatalogOps(Parts(store, mirror), "gw-a")
    first = await ops.put_model("m", spec(), NO_PRECONDITION, no_deadline())
    assert first.etag is not None
    await ops.put_model("m", spec("x"), Precondition(if_match=(first.etag,)), no_deadline())
    with pytest.raises(PreconditionFailed) as refused:
        await ops.put_model("m", spec("y"), Precondition(if_match=(first.etag,)),
                            no_deadline())
    assert refused.value.current not in (None, first.etag)
    with pytest.raises(PreconditionFailed) as none:
        await ops.put_model("m", spec(), Precondition(if_none_match=("*",)), no_deadline())
    assert none.value.current == refused.value.current
    assert mirror.models()["m"].aliases == ["x"]


async def test_delete_removes_and_a_missing_model_is_not_found(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = CatalogOps(Parts(store, mirror), "gw-a")
    await ops.put_model("m", spec(), NO_PRECONDITION, no_deadline())
    await ops.delete_model("m", NO_PRECONDITION, no_deadline())
    assert "m" not in mirror.models() and await store.get(s.MODELS + "m") is None
    with pytest.raises(NotFound) as missing:
        await ops.delete_model("m", NO_PRECONDITION, no_deadline())
    assert missing.value.what == "model"


async def test_nothing_is_written_past_the_deadline(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = CatalogOps(Parts(store, mirror), "gw-a")
    late = Deadline(received=time.monotonic() - 10, bound=5.0)
    with pytest.raises(TooLate, match="more than LLMGW_ADMIN_WRITE_DEADLINE"):
        await ops.put_model("m", spec(), NO_PRECONDITION, late)
    passed = Deadline(received=time.monotonic(), bound=60.0, client=time.time() - 1)
    with pytest.raises(TooLate, match="X-Request-Deadline passed"):
        await ops.put_model("m", spec(), NO_PRECONDITION, passed)
    assert await store.get(s.MODELS + "m") is None


async def test_a_catalog_that_never_settles_is_busy(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = CatalogOps(Parts(store, mirror), "gw-a")
    changed = 0

    async def bump() -> None:
        nonlocal changed
        changed += 1
        await store.put(s.CATALOG_SERIAL, json.dumps({"by": "other"}).encode())

    # Another gateway's write lands between every decision and its write:
    # the serial the decision read is never the one stored.
    real_txn = store.txn

    async def racing_txn(*args: object, **kwargs: object) -> object:
        await bump()
        return await real_txn(*args, **kwargs)  # type: ignore[arg-type]

    store.txn = racing_txn  # type: ignore[method-assign]
    with pytest.raises(Busy) as busy:
        await ops.put_model("m", spec(), NO_PRECONDITION, no_deadline())
    assert busy.value.what == "catalog" and changed == 5
    store.txn = real_txn  # type: ignore[method-assign]
    assert await store.get(s.MODELS + "m") is None


async def test_a_put_of_the_spec_as_stored_writes_nothing(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    """`model show` then `model put` of what it printed: no write, so the
    ETag and the catalog serial stay and no mirror wakes for it; the
    record's preconditions are still checked (docs/design/admin-writes.md, "Catalog writes")."""
    store, mirror = parts
    ops = CatalogOps(Parts(store, mirror), "gw-a")
    made = await ops.put_model("m", spec("a1"), NO_PRECONDITION, no_deadline())
    serial = await store.get(s.CATALOG_SERIAL)
    assert serial is not None
    shown = s.ModelSpec.model_validate(mirror.models()["m"].spec_dump())  # as show prints it
    again = await ops.put_model("m", shown, NO_PRECONDITION, no_deadline())
    assert again.existed and not again.changed and again.etag == made.etag
    assert again.stored == made.stored
    after = await store.get(s.CATALOG_SERIAL)
    assert after is not None and after.mod_revision == serial.mod_revision
    with pytest.raises(PreconditionFailed):
        await ops.put_model("m", shown, Precondition(if_match=('"1"',)), no_deadline())
    with pytest.raises(PreconditionFailed):
        await ops.put_model("m", shown, Precondition(if_none_match=("*",)), no_deadline())
    # A spec that differs only in a field written out at its default is a change:
    # the stored spec is the spec as given.
    changed = await ops.put_model("m", s.ModelSpec.model_validate(
        {"model": "org/m", "gpus": 1, "aliases": ["a1"], "revision": "main"}),
        NO_PRECONDITION, no_deadline())
    assert changed.changed and changed.etag != made.etag
