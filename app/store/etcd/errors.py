"""etcd's failures as the store's typed errors: which gRPC statuses mean an
outage, which a bad request, which a full store, and which a watch rides out.

etcd3aio retries a unary call on UNAVAILABLE / DEADLINE_EXCEEDED (3 attempts)
and then raises `EtcdConnectionError` / `EtcdTransientError`; its
`asyncio.timeout` around the retries raises a bare `TimeoutError`; streams
and every other status come out as raw `grpc.aio.AioRpcError`. `translated`
makes them `LeaseExpired` ("lease not found"), `StoreError` (etcd refused
the request itself), `StoreFull` (a write refused under etcd's NOSPACE
alarm) or `StoreUnavailable` (everything else: a 503).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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

from app.store.base import LeaseExpired, StoreError, StoreFull, StoreUnavailable

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
