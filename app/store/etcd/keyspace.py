"""`KeySpace`: the store contract's keys and values as etcd's protobuf
messages, under one installation's prefix.

Every key is stored under `prefix` (LLMGW_ETCD_PREFIX) and handed back
without it, so several installations (or test runs) can share one etcd.
Pure: no I/O; shared by `EtcdStore`'s calls and its `Watcher`.
"""

from __future__ import annotations

from typing import Any

from etcd3aio import prefix_range_end

# The protobuf Compare is not re-exported; KVService has builders for value and
# create revision but none for mod revision, so all three are built here alike.
from etcd3aio._protobuf import Compare as PbCompare
from etcd3aio._protobuf import RequestOp
from etcd3aio.kv import KVService

from app.store.base import Compare, Delete, Event, KeyValue, Op, Put

PB_EVENT_DELETE = 1  # mvccpb.Event.EventType.DELETE
_PB_RESULT = {"==": PbCompare.EQUAL, "!=": PbCompare.NOT_EQUAL}
_PB_TARGET = {"create": PbCompare.CREATE, "mod": PbCompare.MOD, "value": PbCompare.VALUE}


class KeySpace:
    """Keys under `prefix`: relative ones in, etcd's full ones out, and back."""

    def __init__(self, prefix: str) -> None:
        # "/llmgw" would also match "/llmgw2/...": a prefix names a folder.
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"

    def full(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def relative(self, raw: bytes) -> str | None:
        key = raw.decode()
        return key[len(self.prefix) :] if key.startswith(self.prefix) else None

    def bounds(self, prefix: str) -> tuple[bytes, bytes]:
        """etcd's (key, range_end) for every key under `prefix`."""
        start = self.full(prefix)
        if not start:
            # An empty key is refused by etcd; "\0" to "\0" means every key.
            return b"\x00", b"\x00"
        return start, prefix_range_end(start)

    def key_value(self, kv: Any) -> KeyValue | None:
        key = self.relative(kv.key)
        if key is None:
            return None
        return KeyValue(key, bytes(kv.value), kv.create_revision, kv.mod_revision, kv.lease)

    def event(self, pb: Any) -> Event | None:
        key = self.relative(pb.kv.key)
        if key is None:
            return None
        kv = pb.kv
        if pb.type == PB_EVENT_DELETE:
            return Event("delete", key, b"", kv.mod_revision)
        return Event("put", key, bytes(kv.value), kv.mod_revision, kv.lease, kv.create_revision)

    def compare(self, compare: Compare) -> Any:
        pb = PbCompare(
            result=_PB_RESULT[compare.op],
            target=_PB_TARGET[compare.target],
            key=self.full(compare.key),
        )
        if compare.target == "value":
            if not isinstance(compare.expected, bytes):
                raise TypeError(f"value compare on {compare.key!r} needs bytes")
            pb.value = compare.expected
        else:
            if not isinstance(compare.expected, int):
                raise TypeError(f"{compare.target} compare on {compare.key!r} needs an int")
            if compare.target == "create":
                pb.create_revision = compare.expected
            else:
                pb.mod_revision = compare.expected
        return pb

    def op(self, op: Op) -> RequestOp:
        if isinstance(op, Put):
            return KVService.txn_op_put(self.full(op.key), op.value, lease=op.lease)
        if isinstance(op, Delete):
            return KVService.txn_op_delete(self.full(op.key))
        raise TypeError(f"not a store op: {op!r}")
