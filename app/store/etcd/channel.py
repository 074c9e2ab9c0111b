"""The gRPC channel to etcd, built on resolved addresses and rebuilt when the
names resolve elsewhere.

Why not `Etcd3Client`: it builds the target `ipv4:` + the endpoints as given
(rewriting only `localhost`), which gRPC refuses for a host name ("the target
uri is not valid", reported as UNKNOWN on every call) and for an IPv6
address. Passing it resolved addresses would fix names but not IPv6, and it
would never look the names up again. So this module resolves the names
itself and builds the channel the way etcd3aio's `ConnectionManager` does
(same options), then hangs etcd3aio's public KV and Lease services and the
Watch stub on it. Auth tokens are not supported (nor were they).

With TLS (`https://` endpoints) each channel is verified against the host
name the operator wrote, not the address we dialled: the channel option
`grpc.ssl_target_name_override` carries it. That option is one per channel,
so TLS gets one channel per distinct host (each on that host's addresses,
round robin among them) and the store uses one at a time, moving to the
next after a call failed on it (`failed()`). Plain connections keep one
channel on every address.

Names are resolved with `loop.getaddrinfo` (in a thread: never blocking the
loop), lazily on the first call, and again after a call has failed with every
endpoint (`failed()`): a recreated container gets a new address. A changed
address set gets a new channel; the old one is closed after a grace period so
calls already on it end on their own deadline rather than being cancelled.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc  # type: ignore[import-untyped]  # no type information shipped
from etcd3aio._protobuf import LeaseStub, WatchStub
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from etcd3aio.maintenance import MaintenanceService

from app.store.base import StoreUnavailable
from app.store.etcd.endpoints import EtcdEndpoint, grpc_target
from app.store.etcd.tls import EtcdTls

logger = logging.getLogger(__name__)

# The options of etcd3aio's ConnectionManager: round robin over the members
# (a call fails only when none is reachable), keepalive pings every 10 s that
# notice a dead connection within 5 s more, gRPC's own transparent retries.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.lb_policy_name", "round_robin"),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", True),
    ("grpc.enable_retries", 1),
]
# Attempts per unary call on UNAVAILABLE/DEADLINE_EXCEEDED, inside the call's
# deadline: etcd3aio's default, which rides out one member's restart.
RPC_ATTEMPTS = 3

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def getaddrinfo(host: str, port: int) -> list[str]:
    """The system resolver (/etc/hosts, DNS), run in a thread by asyncio."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True, slots=True)
class Services:
    """What the store's calls and watches use, all on one channel."""

    kv: KVService
    lease: LeaseService
    watch: Any  # etcd3aio's WatchStub: the raw bidirectional Watch call
    # etcd3aio's LeaseStub: the raw LeaseKeepAlive call, kept open between
    # renewals (store.py, `_Renewals`).
    renewals: Any
    # Alarms (is NOSPACE still raised?) and Status (the database's size).
    maintenance: MaintenanceService


# The services the current task was last handed (`services()` is awaited in
# the caller's task, so this is per caller): a failure moves to the next
# host's channel only if it happened on the current one. Several calls that
# fail together on one dead member must move once, not once each (with two
# hosts, twice would be back on the dead one).
_USED: contextvars.ContextVar[Services | None] = contextvars.ContextVar("etcd_services",
                                                                         default=None)


class EtcdChannel:
    """Resolves the endpoints and holds the channel built on them.

    `resolve_interval` bounds how often names are looked up again while every
    call fails: more often finds a moved member sooner, at one lookup per call
    of a gateway that is cut off.
    """

    def __init__(
        self,
        endpoints: Sequence[EtcdEndpoint],
        timeout: float,
        resolver: Resolver = getaddrinfo,
        *,
        resolve_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        tls: EtcdTls | None = None,
    ) -> None:
        self._endpoints = list(endpoints)
        self._tls = tls
        self._timeout = timeout
        self._resolver = resolver
        self._resolve_interval = resolve_interval
        self._clock = clock
        self._has_names = any(e.is_name for e in self._endpoints)
        self._lock = asyncio.Lock()
        # One channel (plain), or one per host name (TLS); `_current` serves.
        self._channels: list[Any] = []
        self._all: list[Services] = []
        self._current = 0
        self.target = ""
        self._stale = True
        self._resolved_at = float("-inf")
        self._last_error = ""
        # Old channels closing after their grace period (task -> channel).
        self._retiring: dict[asyncio.Task[None], Any] = {}

    @property
    def _services(self) -> Services | None:
        return self._all[self._current] if self._all else None

    def failed(self) -> None:
        """A call failed on every endpoint: look the names up again before the
        next; with TLS, the next call goes to the next host's channel."""
        self._stale = True
        if self._all and _USED.get() is self._all[self._current]:
            self._current = (self._current + 1) % len(self._all)

    async def services(self) -> Services:
        """The services on the current channel; resolves first when due.

        Raises StoreUnavailable when no endpoint resolves and no earlier
        channel exists to fall back on.
        """
        if self._services is None or self._due():
            async with self._lock:  # also waits for a lookup already under way
                if self._due():  # another caller may have refreshed meanwhile
                    await self._refresh()
        services = self._services
        if services is None:
            raise StoreUnavailable(self._last_error)  # looked up too recently to retry
        _USED.set(services)
        return services

    def _due(self) -> bool:
        if self._services is not None and not (self._stale and self._has_names):
            return False
        return self._clock() - self._resolved_at >= self._resolve_interval

    async def _refresh(self) -> None:
        self._resolved_at = self._clock()
        found = await asyncio.gather(*(self._addresses(ep) for ep in self._endpoints))
        addresses = [a for result in found if not isinstance(result, str) for a in result]
        errors = [result for result in found if isinstance(result, str)]
        if not addresses:
            if self._services is not None:
                return  # keep the channel we have; stay stale, try later
            self._last_error = "etcd: cannot resolve " + "; ".join(errors)
            raise StoreUnavailable(self._last_error)
        if errors:
            # The others serve meanwhile; these are looked up again the next
            # time every endpoint fails.
            logger.warning("etcd endpoints not resolved: %s", "; ".join(errors))
        self._stale = False
        plan = self._plan(found)
        target = "; ".join(f"{host}={t}" if host else t for host, t in plan)
        if target == self.target:
            return
        if self.target:
            logger.info("etcd endpoints now resolve to %s (were %s)", target, self.target)
        old = self._channels
        self._channels = [self._open(host, t) for host, t in plan]
        self._all = [
            Services(
                KVService(ch, max_attempts=RPC_ATTEMPTS),
                LeaseService(ch, max_attempts=RPC_ATTEMPTS),
                WatchStub(ch),
                LeaseStub(ch),
                MaintenanceService(ch, max_attempts=RPC_ATTEMPTS),
            )
            for ch in self._channels
        ]
        self._current %= len(self._all)
        self.target = target
        for channel in old:
            task = asyncio.create_task(self._close_later(channel), name="etcd-channel-retire")
            self._retiring[task] = channel
            task.add_done_callback(lambda t: self._retiring.pop(t, None))

    def _plan(self, found: Sequence[list[tuple[str, int]] | str]) -> list[tuple[str, str]]:
        """(host name to verify, gRPC target) per channel: one channel on
        every address in clear (host ""), one per host with TLS."""
        if self._tls is None:
            return [("", grpc_target([a for r in found if not isinstance(r, str) for a in r]))]
        by_host: dict[str, list[tuple[str, int]]] = {}
        for ep, result in zip(self._endpoints, found, strict=True):
            if not isinstance(result, str):
                by_host.setdefault(ep.host, []).extend(result)
        return [(host, grpc_target(addrs)) for host, addrs in by_host.items()]

    def _open(self, host: str, target: str) -> Any:
        if self._tls is None:
            return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        # The certificate must name `host` as the operator wrote it (an IP
        # endpoint: that IP), whatever address the target dials.
        options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", host)]
        return grpc.aio.secure_channel(target, self._tls.credentials(), options=options)

    async def _addresses(self, ep: EtcdEndpoint) -> list[tuple[str, int]] | str:
        """The endpoint's addresses, or why it has none."""
        if not ep.is_name:
            return [(ep.host, ep.port)]
        try:
            async with asyncio.timeout(self._timeout):
                found = await self._resolver(ep.host, ep.port)
        except (OSError, TimeoutError) as exc:
            return f"{ep}: {exc or 'no answer in time'}"
        return [(ip, ep.port) for ip in found] or f"{ep}: no address"

    async def _close_later(self, channel: Any) -> None:
        # Unary calls and keepalives end within one timeout; a watch still
        # open after that is cancelled and reopens on the new channel.
        await channel.close(grace=self._timeout + 1.0)

    async def close(self) -> None:
        retiring, self._retiring = self._retiring, {}
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        channels, self._channels, self._all = self._channels, [], []
        for ch in [*retiring.values(), *channels]:
            await ch.close()
