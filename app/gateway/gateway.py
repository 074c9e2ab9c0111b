"""One gateway: the parts the routes and the metrics use, and the first step
of its stop (docs/design/stopping.md).

Built by the composition root, app/gateway/assembly.py (`build_gateway`);
the parts that need the store (`Control`) exist once it has started. What
runs in the background, and the order it starts and stops in, is its
supervisor's (app/gateway/supervisor.py). A stop begins (`begin_shutdown`)
by giving up the lead while requests still run; `stop()` then stops the
supervisor's services in reverse and revokes the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app import compiled
from app.gateway.stopping import ended

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from app.agent.agent import Agent
    from app.control.adapters import AdapterLoop
    from app.control.compaction import Compactor
    from app.control.key_usage import KeyUsageWriter
    from app.control.keyfiles import ProviderKeys
    from app.control.keys import SecretRing
    from app.control.leader import Elector
    from app.control.mirror import Mirror
    from app.control.placement.agentversion import Window
    from app.control.reconciler import Reconciler
    from app.control.usage import UsagePublisher
    from app.gateway.key_shares import KeyShares
    from app.gateway.metrics import GatewayMetrics
    from app.gateway.publish import Publisher
    from app.gateway.request_series import RequestSeries
    from app.gateway.router_usage import LastUse
    from app.gateway.settings import Settings
    from app.gateway.supervisor import Leadership, Supervisor
    from app.gateway.worker_metrics import WorkerMetrics
    from app.router.proxy import Proxy
    from app.router.table import RouteTable
    from app.router.tracing import OtelTracer
    from app.store.base import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Control:
    """The parts built once the store is open (assembly.py, `_connect`)."""

    store: Store
    mirror: Mirror
    elector: Elector
    publisher: Publisher  # the mirror into the router's tables
    reconciler: Reconciler  # leader only, as the two below
    adapters: AdapterLoop
    usage: UsagePublisher
    compactor: Compactor
    key_shares: KeyShares
    # Client key usage: counted by the router, written in batches here,
    # where control and router meet (DESIGN invariant 8).
    key_usage: KeyUsageWriter


class Gateway:
    """What the composition root (assembly.py) sets on it is all there is:
    the routes read these parts, the supervisor runs them."""

    settings: Settings
    agent_window: Window  # the agent versions new replicas may go to
    secrets: SecretRing
    admin_token: str
    provider_keys: ProviderKeys
    table: RouteTable
    metrics: GatewayMetrics
    series: RequestSeries
    last_use: LastUse
    tracer: OtelTracer | None
    proxy: Proxy
    # Under `llmgw serve --workers N`: every worker's request figures,
    # summed for /metrics (worker_metrics.py).
    worker_metrics: WorkerMetrics | None
    supervisor: Supervisor
    leadership: Leadership

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.control: Control | None = None
        self.agent: Agent | None = None  # all-in-one mode's, once it runs
        # Set when the server starts stopping (or a signal came: signalled()):
        # long polls answer at once, /readyz says 503.
        self.closing, self._signalled = asyncio.Event(), False
        self._stepping_down: asyncio.Task[None] | None = None

    # The parts that exist only once started; routes use them per request.
    @property
    def built(self) -> Control:
        assert self.control is not None, "gateway not started"
        return self.control

    @property
    def store(self) -> Store:
        return self.built.store

    @property
    def mirror(self) -> Mirror:
        return self.built.mirror

    @property
    def elector(self) -> Elector:
        return self.built.elector

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Runs `work` in the background until it ends or the gateway stops
        (a route's follow-up that must outlive its answer)."""
        self.supervisor.spawn(work, name)

    @property
    def started(self) -> bool:
        return self.control is not None

    @property
    def ready(self) -> bool:
        return self.control is not None and self.control.mirror.ready

    async def start(self, serving: bool = False) -> None:
        """`serving`: with what only the app's process runs (its lifespan,
        app/gateway/main.py); a test's gateway runs without."""
        await self.supervisor.start(serving)
        logger.info("gateway %s started (%s store; router %s)", self.settings.gateway_id,
                    "etcd" if self.settings.uses_etcd else "embedded", compiled.state())

    @property
    def stopping(self) -> bool:
        return self._signalled or self.closing.is_set()

    def signalled(self) -> None:
        """From a signal handler, which may interrupt the loop anywhere: a
        flag, and begin_shutdown() at the loop's next turn."""
        self._signalled = True
        with contextlib.suppress(RuntimeError):  # not serving yet: shutdown() begins it
            asyncio.get_running_loop().call_soon_threadsafe(self.begin_shutdown)

    def begin_shutdown(self) -> None:
        """First step of a clean stop, at the signal, while requests still
        run: /readyz answers 503, long polls end, the in-process agent
        stops, and this gateway gives up the lead (keeping its lease)."""
        if self.closing.is_set():
            return
        self.closing.set()
        self.supervisor.cancel("local-agent")  # stop() shuts it down (engines per the settings)
        if self.control is not None:
            self._stepping_down = asyncio.create_task(self._step_down(), name="step-down")

    async def _step_down(self) -> None:
        # The campaign first, or it would take the lead again.
        await self.supervisor.halt("election-campaign")
        await self.leadership.close()
        await self.elector.step_down()

    async def stop_leading(self) -> None:
        """The lead given up (begin_shutdown), or at least no loop left
        that leads: the stop's step before the lease is revoked."""
        if self._stepping_down is not None:  # not cancelled: it gives up the lead
            await ended([self._stepping_down], self.supervisor.wait, "giving up the lead")
        await self.leadership.close()

    async def stop(self) -> None:
        self.closing.set()
        await self.supervisor.stop()
        logger.info("gateway %s stopped", self.settings.gateway_id)
