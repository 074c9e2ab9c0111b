"""etcd's wire types for EtcdStore: protobuf compares and ops, gRPC status
codes, and the mapping of client failures onto the store's typed errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# grpc ships no type information; etcd3aio raises its AioRpcError unmapped for
# every status other than UNAVAILABLE/DEADLINE_EXCEEDED/UNAUTHENTICATED/
# PERMISSION_DENIED, so the status code has to be read here.
import grpc  # type: ignore[import-untyped]
from etcd3aio import (
    EtcdConnectionError,
    EtcdError,
    EtcdPermissionDeniedError,
    EtcdTransientError,
    EtcdUnauthenticatedError,
)

# The protobuf Compare is not re-exported; KVService has builders for value and
# create revision but none for mod revision, so all three are built here alike.
from etcd3aio._protobuf import Compare as PbCompare
from etcd3aio._protobuf import RequestOp
from etcd3aio.kv import KVService

from app.store.base import (
    Compare,
    Delete,
    LeaseExpired,
    Op,
    Put,
    StoreError,
    StoreFull,
    StoreUnavailable,
)

UNAVAILABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# etcd's answers about the request itself (a compacted revision, a request
# too large): a bug of ours, not an outage, so StoreError. Every other status
# means the store cannot serve us now, and is StoreUnavailable (a 503, never a
# 500): UNKNOWN is what gRPC reports for a target it cannot use (a host name
# in an `ipv4:` target), RESOURCE_EXHAUSTED an etcd out of space, the auth
# codes an etcd that refuses us.
REQUEST_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.NOT_FOUND,
    }
)
# A watch stream that fails with one of these is reopened; any other status
# (permission, bad request) is raised as StoreError to the reader.
WATCH_RETRY_CODES = UNAVAILABLE_CODES | {
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}
# etcd's words for a write refused under its NOSPACE alarm (RESOURCE_EXHAUSTED,
# "etcdserver: mvcc: database space exceeded"). The same status also means a
# message over gRPC's size cap, which is not a full store: hence the words.
NOSPACE_DETAIL = "database space exceeded"
# etcd's answer to a compaction at or below the compacted revision.
COMPACTED_DETAIL = "required revision has been compacted"
WATCH_MIN_BACKOFF = 0.1
PB_EVENT_DELETE = 1  # mvccpb.Event.EventType.DELETE
_PB_RESULT = {"==": PbCompare.EQUAL, "!=": PbCompare.NOT_EQUAL}
_PB_TARGET = {"create": PbCompare.CREATE, "mod": PbCompare.MOD, "value": PbCompare.VALUE}


@contextlib.contextmanager
def translated(operation: str) -> Iterator[None]:
    """Turns etcd3aio and gRPC failures into the store's typed errors."""
    try:
        yield
    except (
        EtcdConnectionError,
        EtcdTransientError,
        EtcdUnauthenticatedError,
        EtcdPermissionDeniedError,
    ) as exc:
        raise StoreUnavailable(f"etcd {operation}: {exc}") from exc
    except TimeoutError as exc:
        raise StoreUnavailable(f"etcd {operation}: no answer in time") from exc
    except grpc.aio.AioRpcError as exc:
        code, detail = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
            raise LeaseExpired(f"etcd {operation}: {detail}") from exc
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and NOSPACE_DETAIL in detail:
            raise StoreFull(f"etcd {operation}: out of space (NOSPACE alarm): {detail}") from exc
        if code in REQUEST_CODES:
            raise StoreError(f"etcd {operation}: {code.name} {detail}") from exc
        raise StoreUnavailable(f"etcd {operation}: {code.name} {detail}") from exc
    except grpc.aio.UsageError as exc:
        # A call on a channel closed under it (replaced after re-resolving).
        raise StoreUnavailable(f"etcd {operation}: {exc}") from exc
    except EtcdError as exc:
        raise StoreError(f"etcd {operation}: {exc}") from exc


def pb_compare(compare: Compare, key: bytes) -> Any:
    pb = PbCompare(
        result=_PB_RESULT[compare.op],
        target=_PB_TARGET[compare.target],
        key=key,
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

def pb_op(op: Op, key: bytes) -> RequestOp:
    if isinstance(op, Put):
        return KVService.txn_op_put(key, op.value, lease=op.lease)
    if isinstance(op, Delete):
        return KVService.txn_op_delete(key)
    raise TypeError(f"not a store op: {op!r}")
