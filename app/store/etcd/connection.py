"""`EtcdConnection`: the link to etcd that `EtcdStore`'s calls and its
`Watcher` share.

It owns the channel (app/store/etcd/channel.py: host names, IPv6,
re-resolving), made by `open()` and ended by `close()`, and what the calls'
outcomes say about reaching etcd: `calling` turns a call's failure into the
store's typed error (app/store/etcd/errors.py) and tells the health tracker
(app/store/health.py) whether etcd is reachable or out of space, which
`health()` reports without I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from app.store.base import StoreError, StoreFull, StoreHealth, StoreUnavailable
from app.store.etcd.channel import EtcdChannel, Resolver, Services
from app.store.etcd.endpoints import EtcdEndpoint
from app.store.etcd.errors import translated
from app.store.etcd.tls import EtcdTls, explained
from app.store.health import HealthTracker


class EtcdConnection:
    """No I/O until the first call after `open()`. `timeout` bounds each call.

    `resolve_interval` and `resolver` are the channel's (how often and how
    names are looked up again while every call fails); `tls` None speaks in
    clear.
    """

    def __init__(
        self,
        endpoints: Sequence[EtcdEndpoint],
        timeout: float,
        resolver: Resolver,
        resolve_interval: float,
        tls: EtcdTls | None,
    ) -> None:
        self.timeout = timeout
        self._endpoints = endpoints
        self._resolver = resolver
        self._resolve_interval = resolve_interval
        self._tls = tls
        # None until `open()` and after `close()`.
        self.channel: EtcdChannel | None = None
        self._closed = False
        self._health = HealthTracker("etcd at " + ",".join(map(str, endpoints)))

    def open(self) -> None:
        """Prepares the channel. Names are resolved and members connected
        lazily: a down etcd (or a name not resolving yet) is reported by the
        first call, not here, so a gateway can start while etcd restarts."""
        self.channel = EtcdChannel(self._endpoints, self.timeout, self._resolver,
                                   resolve_interval=self._resolve_interval, tls=self._tls)
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        channel, self.channel = self.channel, None
        if channel is not None:
            await channel.close()

    @property
    def closed(self) -> bool:
        """Closed by `close()`: a failure from now on is ours, not an outage."""
        return self._closed

    def health(self) -> StoreHealth:
        return self._health.current()

    def reached(self) -> None:
        """An answer that came outside `calling` (a watch created)."""
        self._health.succeeded()

    def space_back(self) -> None:
        """etcd says its NOSPACE alarm is gone."""
        self._health.space_back()

    async def services(self) -> Services:
        if self.channel is None:
            raise StoreUnavailable("etcd store is not connected")
        return await self.channel.services()

    @contextlib.contextmanager
    def calling(self, operation: str, write: bool = False) -> Iterator[None]:
        """`translated`, and what the outcome says about reaching etcd: any
        answer (even "lease not found") proves it reachable; an unavailable
        store is reported, and its names are looked up again next time. A
        `write` (a call etcd refuses under NOSPACE) that succeeds proves
        the space back; a refused one says the store is full."""
        try:
            with translated(operation):
                yield
        except StoreFull as exc:
            self._health.full(str(exc))
            raise
        except StoreUnavailable as exc:
            self.lost(str(exc))
            raise
        except StoreError:
            self._health.succeeded()
            raise
        self._health.succeeded(write)

    def lost(self, reason: str) -> None:
        """A call failed for want of etcd: said once by the health tracker,
        and the channel looks the names up again before the next."""
        if self._closed:
            return  # our own close, not an outage
        # gRPC's words for a failed handshake, said as what to fix.
        self._health.failed(explained(reason) if self._tls else reason)
        if self.channel is not None:
            self.channel.failed()
