"""Client key writes (app/control/ops/key_ops.py), in-process against the
embedded store and a running mirror: no HTTP. A store whose answers are
lost stands in for an etcd that timed out after applying a write."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import pytest

from app.control import state as s
from app.control.keys import hash_client_key
from app.control.mirror import Mirror
from app.control.ops.base import Parts
from app.control.ops.conditions import Deadline, no_deadline
from app.control.ops.key_ops import PREFIX_CHARS, KeyOps
from app.control.ops.refusals import NotFound, OutcomeUnknown, TooLate
from app.store.base import Compare, Op, Store, StoreUnavailable, TxnResult
from app.store.embedded import EmbeddedStore


class LostAnswers:
    """Applies each transaction, then loses its answer; `reads_fail` makes
    every read fail too (the store gone dark right after the write)."""

    def __init__(self, inner: Store, reads_fail: bool = False, lands: bool = True) -> None:
        self.inner = inner
        self.reads_fail = reads_fail
        self.lands = lands

    async def txn(self, compares: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        if self.lands:
            await self.inner.txn(compares, success, failure)
        raise StoreUnavailable("timed out")

    async def get(self, key: str) -> Any:
        if self.reads_fail:
            raise StoreUnavailable("timed out")
        return await self.inner.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Spawned:
    def __init__(self) -> None:
        self.work: list[tuple[Coroutine[Any, Any, None], str]] = []

    def __call__(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self.work.append((work, name))


def limits() -> s.KeyLimits:
    return s.KeyLimits()


async def test_a_key_is_saved_by_its_hash_and_shown_once(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = KeyOps(Parts(store, mirror), Spawned())
    made = await ops.create("ci", ["m"], limits(), None, time.time(), no_deadline())
    kv = await store.get(s.KEYS + hash_client_key(made.key))
    assert kv is not None and made.key.encode() not in kv.value
    assert s.ClientKey.model_validate_json(kv.value) == made.record
    assert made.record.prefix == made.key[:PREFIX_CHARS]
    assert [r.id for r in mirror.client_keys().values()] == [made.record.id]  # settled


async def test_revoke_deletes_the_key_and_an_unknown_id_is_not_found(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = KeyOps(Parts(store, mirror), Spawned())
    made = await ops.create("ci", [], limits(), None, time.time(), no_deadline())
    await ops.revoke(made.record.id, no_deadline())
    assert mirror.client_keys() == {}
    assert await store.get(s.KEYS + hash_client_key(made.key)) is None
    with pytest.raises(NotFound) as missing:
        await ops.revoke(made.record.id, no_deadline())
    assert missing.value.what == "key"


async def test_no_key_is_made_or_revoked_past_the_deadline(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = KeyOps(Parts(store, mirror), Spawned())
    late = Deadline(received=time.monotonic() - 10, bound=1.0)
    with pytest.raises(TooLate):
        await ops.create("ci", [], limits(), None, time.time(), late)
    assert (await store.range(s.KEYS)).kvs == []
    made = await ops.create("ci", [], limits(), None, time.time(), no_deadline())
    with pytest.raises(TooLate):
        await ops.revoke(made.record.id, late)
    assert len(mirror.client_keys()) == 1


async def test_a_saved_key_whose_answer_was_lost_is_read_back_and_shown(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = KeyOps(Parts(LostAnswers(store), mirror), Spawned())  # type: ignore[arg-type]
    made = await ops.create("ci", [], limits(), None, time.time(), no_deadline())
    assert await store.get(s.KEYS + hash_client_key(made.key)) is not None


async def test_a_key_not_found_after_a_lost_answer_is_refused_as_not_saved(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = KeyOps(Parts(LostAnswers(store, lands=False), mirror), Spawned())  # type: ignore[arg-type]
    with pytest.raises(OutcomeUnknown) as absent:
        await ops.create("ci", [], limits(), None, time.time(), no_deadline())
    assert absent.value.known_absent and "not saved" in absent.value.detail
    assert (await store.range(s.KEYS)).kvs == []


async def test_a_key_whose_outcome_is_unknown_is_not_shown_and_is_revoked_later(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    spawned = Spawned()
    dark = LostAnswers(store, reads_fail=True)
    ops = KeyOps(Parts(dark, mirror), spawned)  # type: ignore[arg-type]
    with pytest.raises(OutcomeUnknown) as unknown:
        await ops.create("ci", [], limits(), None, time.time(), no_deadline())
    assert not unknown.value.known_absent and unknown.value.id in unknown.value.detail
    (saved,) = (await store.range(s.KEYS)).kvs  # it did land
    ((work, name),) = spawned.work
    assert name == f"revoke-key-{unknown.value.id}"
    dark.txn = store.txn  # type: ignore[method-assign]  # the store answers again
    await asyncio.wait_for(work, 5)
    assert await store.get(saved.key) is None


async def test_a_revocation_retries_until_the_store_answers(
        parts: tuple[EmbeddedStore, Mirror]) -> None:
    store, mirror = parts
    ops = KeyOps(Parts(store, mirror), Spawned())
    await store.put("keys/x", b"v")
    dark = LostAnswers(store)
    failing = KeyOps(Parts(dark, mirror), Spawned())  # type: ignore[arg-type]
    # Every try fails before the write lands: nothing deleted, and it gives up.
    dark.txn = _always_down  # type: ignore[method-assign]
    await failing.revoke_unshown("keys/x", b"v", "x", tries=3, pause=0.0)
    assert await store.get("keys/x") is not None
    # A value since replaced is not deleted: only the record never shown is.
    await ops.revoke_unshown("keys/x", b"other", "x", tries=1, pause=0.0)
    assert await store.get("keys/x") is not None
    await ops.revoke_unshown("keys/x", b"v", "x", tries=1, pause=0.0)
    assert await store.get("keys/x") is None


async def _always_down(*args: object, **kwargs: object) -> TxnResult:
    raise StoreUnavailable("down")
