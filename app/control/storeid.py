"""The store's id: what tells one store's revisions from another's.

An agent keeps the revision of the last assignments it applied across its
restarts, and ignores an older answer (docs/design/agent.md, "Agent restarts").
That comparison means something only within one store: a new etcd, or a fresh
embedded database, counts its revisions from 1 again. etcd's own cluster id
cannot tell: it is a hash of the members' names and peer URLs, so an etcd
wiped and bootstrapped again with the same flags has the same one. Hence a
random id kept in the store itself (`store`), created once by the first
gateway that finds none; a store that lost its data has lost its id too.
"""

from __future__ import annotations

import json
import secrets

from pydantic import ValidationError

from app.control import state as s
from app.store.base import Compare, Put, Store


def parse(value: bytes) -> str:
    """The id in a stored `store` value; "" when unreadable."""
    try:
        return s.StoreId.model_validate_json(value).id
    except ValidationError:
        return ""


async def ensure(store: Store, now: float) -> str:
    """The store's id, created if it has none (create-only, so of several
    gateways starting together one creates it and the others read it)."""
    kv = await store.get(s.STORE_ID)
    if kv is None:
        new = s.StoreId(id=secrets.token_hex(16), created=now)
        res = await store.txn([Compare.absent(s.STORE_ID)],
                              [Put(s.STORE_ID, json.dumps(new.model_dump()).encode())])
        if res.succeeded:
            return new.id
        kv = await store.get(s.STORE_ID)
    return parse(kv.value) if kv is not None else ""
