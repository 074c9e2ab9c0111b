"""One gateway's parts and their lifecycle. Built by main.create_app().

Start order matters: the store, then the mirror (loaded before /readyz says
yes), then the election, the reconciler, the router's upstream pool, and, in
all-in-one mode, the local agent. A stop begins (`begin_shutdown`) by giving
up the lead while requests still run; `stop()` then runs in reverse and
revokes the lease (docs/architecture.md, "Stopping").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from app import __version__
from app.agent.agent import Agent
from app.agent.config import AgentConfig
from app.agent.engines import available_engines, resolve_vllm
from app.agent.gpuhealth import GpuHealth, load_pynvml
from app.agent.gpus import declared_hardware, probe
from app.agent.nodeops import NodeOpsConfig
from app.control import catalog, storeid
from app.control import state as s
from app.control.adapters import AdapterLoop
from app.control.agentversion import default_window
from app.control.compaction import Compactor
from app.control.keyfiles import ProviderKeys, own_files
from app.control.keys import SecretRing, hash_client_key
from app.control.leader import Elector
from app.control.mirror import Mirror
from app.control.reconciler import Reconciler
from app.control.usage import UsagePublisher
from app.gateway.key_shares import KeyShares
from app.gateway.metrics import GatewayMetrics
from app.gateway.node_agents import NodeAgents
from app.gateway.publish import Publisher
from app.gateway.request_series import RequestSeries
from app.gateway.router_usage import LastUse, RouterUsage
from app.gateway.settings import Settings
from app.gateway.stopping import ended
from app.router.proxy import Proxy
from app.router.responses import tag_keys
from app.router.table import RouteTable
from app.router.timeouts import Timeouts
from app.store.base import Store, StoreUnavailable
from app.tls import pinned_context
from app.wire.tokens import node_token

if TYPE_CHECKING:
    from app.router.tracing import OtelTracer

logger = logging.getLogger(__name__)


async def open_store(settings: Settings) -> Store:
    if settings.uses_etcd:
        from app.store.etcd import EtcdStore
        from app.store.etcd_tls import for_endpoints

        tls = for_endpoints(settings.endpoints, settings.etcd_ca_file, settings.etcd_cert_file,
                            settings.etcd_key_file)
        return await EtcdStore.open(settings.endpoints, prefix=settings.etcd_prefix,
                                    timeout=settings.etcd_timeout, tls=tls)
    from app.store.embedded import EmbeddedStore

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return await EmbeddedStore.open(settings.data_dir / "state.db")


class Gateway:
    def __init__(
        self,
        settings: Settings,
        store_factory: Callable[[Settings], Awaitable[Store]] = open_store,
        campaign: bool = True,
    ) -> None:
        if not settings.uses_etcd:
            settings.ensure_local_secrets()
        assert settings.secret is not None and settings.admin_token is not None, (
            "LLMGW_SECRET and LLMGW_ADMIN_TOKEN must be set with etcd"
        )
        self.settings = settings
        # The agent versions new replicas may go to (app/control/agentversion.py).
        self.agent_window = default_window(settings.min_agent_version)
        self.secret = settings.secret.get_secret_value()
        # Every engine key and node token goes through it: during a rotation
        # it derives from the previous secret too (keys.SecretRing).
        prev = settings.previous_secret
        self.secrets = SecretRing(self.secret, prev.get_secret_value() if prev else None)
        self.admin_token = settings.admin_token.get_secret_value()
        self._store_factory = store_factory
        # False for the workers of a gateway other than its first: they hold a
        # lease but never lead (docs/architecture.md, "Workers").
        self._campaign = campaign
        # External models' key files, read off the loop (docs/architecture.md,
        # Security, "Files an admin names").
        self.provider_keys = ProviderKeys(settings.provider_key_dir, own_files(
            settings.data_dir, [v for _, v in settings if isinstance(v, Path)]))
        self.table = RouteTable()
        self.metrics = GatewayMetrics(self)
        # Notes each model's last use for the usage snapshots, then counts
        # the request in the last minutes' series (the cluster page's
        # charts, app/gateway/request_series.py), then in the metrics.
        self.series = RequestSeries(then=self.metrics.requests)
        self.last_use = LastUse(then=self.series)
        self.tracer: OtelTracer | None = None
        if settings.otlp_endpoint:  # imported only then: zero cost when unset
            from app.router.tracing import otlp_tracer

            self.tracer = otlp_tracer(settings.otlp_endpoint, settings.gateway_id)
        self.proxy = Proxy(self.table, hash_client_key, Timeouts(
            connect=settings.connect_timeout, first_byte=settings.first_byte_timeout,
            idle=settings.stream_idle_timeout, request=settings.request_timeout,
            cooldown=settings.replica_cooldown, cold_start=settings.cold_start_timeout,
            cold_start_held=settings.cold_start_max_held, spill_hold=settings.spill_hold),
            observer=self.last_use,
            affinity=settings.router_affinity,
            count_concurrency=settings.prompt_count_concurrency,
            count_timeout=settings.prompt_count_timeout, tracer=self.tracer,
            response_keys=tag_keys(self.secrets.current, self.secrets.previous))
        self._store: Store | None = None
        self._mirror: Mirror | None = None
        self._elector: Elector | None = None
        self.agent: Agent | None = None
        self._agent_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        # Set when the server starts stopping (or a signal came: signalled()):
        # long polls answer at once, /readyz says 503.
        self.closing, self._signalled = asyncio.Event(), False
        # The loops that lead, stopped at the start of a stop (`begin_shutdown`).
        self._leading: list[asyncio.Task[Any]] = []
        self.adapters: AdapterLoop | None = None
        self._stepping_down: asyncio.Task[None] | None = None

    # The parts that exist only once started; routes use them per request.
    @property
    def store(self) -> Store:
        assert self._store is not None, "gateway not started"
        return self._store

    @property
    def mirror(self) -> Mirror:
        assert self._mirror is not None, "gateway not started"
        return self._mirror

    @property
    def elector(self) -> Elector:
        assert self._elector is not None, "gateway not started"
        return self._elector

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Runs `work` in the background until it ends or the gateway stops
        (a route's follow-up that must outlive its answer)."""
        task = asyncio.create_task(work, name=name)
        self._tasks.append(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    @property
    def started(self) -> bool:
        return self._store is not None

    @property
    def ready(self) -> bool:
        return self._mirror is not None and self._mirror.ready

    async def start(self) -> None:
        st = self.settings
        self._store = await self._store_factory(st)
        if st.catalog_file is not None:
            await self._seed(catalog.load_file(st.catalog_file, st.model_root_list,
                                               st.provider_key_dir))
        # In the background: with the store down, start must not wait on it.
        self._tasks.append(asyncio.create_task(self._claim_store_id(), name="store-id"))
        self._mirror = Mirror(self._store)
        publisher = Publisher(self._mirror, self.table, self.secrets, self.agent_window,
                              self.provider_keys, gateway_id=st.gateway_id,
                              # An agent heartbeats at least every third of the
                              # node TTL: a key gone with its agent alive is back
                              # within two heartbeats (the first may still find
                              # the store coming back; app/gateway/node_grace.py).
                              node_grace=st.node_ttl / 2 + 2)
        # Loads in the background, retrying while the store is unreachable;
        # /readyz says no until it has.
        self._mirror.start()
        info = s.GatewayInfo(id=st.gateway_id, url=st.public_url, version=__version__,
                             started=time.time(), secret=self.secrets.current_id)
        self._elector = Elector(self._store, info, st.lease_ttl, mirror=self._mirror)
        reconciler = Reconciler(self._store, self._mirror, self._elector,
                                drain_seconds=st.drain_seconds, interval=st.reconcile_interval,
                                node_grace=st.node_grace,
                                idle_slack=st.usage_refresh + st.usage_interval,
                                scale_down_window=st.scale_down_window,
                                default_load_target=st.default_load_target,
                                saturated_after=st.saturated_after,
                                agent_window=self.agent_window, secrets=self.secrets)
        self.adapters = AdapterLoop(self._store, self._mirror, self._elector, self.secrets,
                                    shrink_after=st.adapter_shrink_after,
                                    drain=st.drain_seconds)
        elector = self._elector
        usage = UsagePublisher(self._store, self._mirror,
                               RouterUsage(self.table, self.last_use, publisher),
                               st.gateway_id, lambda: elector.lease, refresh=st.usage_refresh)
        mirror = self._mirror
        compactor = Compactor(self._store, lambda: elector.is_leader,
                              lambda: mirror.revision if mirror.ready else 0,
                              st.etcd_compaction_interval)
        # Engine loads come from each node's agent (docs/architecture.md,
        # "Choosing a replica").
        self.proxy.loads.directory = NodeAgents(self._mirror, self.secrets)
        self.key_shares = KeyShares(self._store, self._mirror, self.proxy.limits, st.gateway_id,
                                    lambda: elector.lease, refresh=st.key_share_interval,
                                    until=lambda: elector.proven_until(st.lease_ttl),
                                    hold=st.lease_ttl)
        self.key_shares.start()
        await self.proxy.start()
        self._leading = [
            asyncio.create_task(self._every(elector.campaign, "campaign"),
                                name="election-campaign"),
            asyncio.create_task(reconciler.run(), name="reconciler"),
            asyncio.create_task(self.adapters.run(st.reconcile_interval), name="adapters"),
        ] if self._campaign else []
        self._tasks += [
            *self._leading,
            # Two loops: a renewal never waits behind a campaign stuck on a
            # slow store (docs/architecture.md, Election).
            asyncio.create_task(self._every(elector.renew, "renewal"), name="election-renew"),
            asyncio.create_task(publisher.run(st.publish_interval), name="publisher"),
            asyncio.create_task(usage.run(st.usage_interval), name="usage"),
            # Leader only (each pass asks): docs/architecture.md, A month of uptime.
            asyncio.create_task(compactor.run(), name="compaction"),
            asyncio.create_task(self.key_shares.run(st.key_share_interval),
                                name="key-shares"),
        ]
        if st.local_agent:
            self._agent_task = asyncio.create_task(self._run_local_agent(), name="local-agent")
            self._tasks.append(self._agent_task)
        logger.info("gateway %s started (%s store)", st.gateway_id,
                    "etcd" if st.uses_etcd else "embedded")

    async def _seed(self, models: dict[str, s.ModelSpec], retry: float = 0.0) -> None:
        """Seeds the catalog from LLMGW_CATALOG_FILE if the store has none.

        Tried once before the mirror loads, so that its first load has the
        catalog; with the store unreachable, retried in the background (the
        gateway serves meanwhile, as it would without a file)."""
        if retry:
            await asyncio.sleep(retry)
        try:
            done = await catalog.seed(self.store, models, self.settings.gateway_id, time.time())
        except StoreUnavailable as exc:
            logger.debug("catalog seed deferred, store unavailable: %s", exc)
            self._tasks.append(asyncio.create_task(
                self._seed(models, retry=min(max(2 * retry, 0.5), 10.0)), name="catalog-seed"))
            return
        if done:
            logger.info("seeded the catalog with %d models from %s (gateway %s)", len(models),
                        self.settings.catalog_file, self.settings.gateway_id)
        else:
            logger.info("catalog already in the store: %s not used", self.settings.catalog_file)

    async def _claim_store_id(self) -> None:
        """Creates the store's id if it has none (app/control/storeid.py),
        retrying while the store is unreachable. Until the mirror has it,
        agents are answered without one and compare revisions within their
        run only, as with a gateway older than store ids."""
        retry = 0.5
        while True:
            try:
                found = await storeid.ensure(self.store, time.time())
            except StoreUnavailable as exc:
                logger.debug("store id deferred, store unavailable: %s", exc)
                await asyncio.sleep(retry)
                retry = min(2 * retry, 10.0)
                continue
            logger.info("store id %s", found)
            return

    async def _every(self, step: Callable[[], Awaitable[None]], what: str) -> None:
        while True:
            try:
                await step()
            except Exception:
                # The steps handle store failures; anything else is a bug, but
                # the loop must outlive it or this gateway never leads again.
                logger.exception("election %s crashed", what)
            await asyncio.sleep(self.settings.election_interval)

    async def _run_local_agent(self) -> None:
        """All-in-one mode: an agent in this process, reaching us over loopback."""
        st = self.settings
        host = "127.0.0.1" if st.host in ("0.0.0.0", "::", "") else st.host
        url = f"{st.scheme}://{host}:{st.port}"
        # With TLS on, this agent trusts our own certificate and nothing else
        # (pinned: app/tls.py); it need not know the CA that signed it.
        tls = pinned_context(st.tls_cert_file) if st.tls_cert_file is not None else None
        await _wait_http(url + "/healthz", tls)
        # NVML or nvidia-smi can take seconds: not on the event loop.
        hw = (declared_hardware(st.local_gpus) if st.local_gpus is not None
              else await asyncio.to_thread(probe))
        gpus = hw.gpus
        self.agent = Agent(AgentConfig(
            gateways=[url], node=st.local_node, token=node_token(self.secret, st.local_node),
            gpus=gpus, engines=available_engines(gpus, st.vllm_bin),
            work_dir=st.data_dir / "agent", vllm_bin=resolve_vllm(st.vllm_bin),
            advertise_host=host,
            # By default engines outlive `llmgw serve`: the next run on this
            # data_dir adopts them (work_dir/engines.json), so a restart or
            # upgrade reloads no model. The leader keeps their replicas over
            # the restart for node_grace seconds.
            stop_engines_on_exit=st.stop_engines_on_exit, gateway_tls=tls,
            start_timeout=st.engine_start_timeout,
            ops=NodeOpsConfig(hardware=hw,
                              rediscover=probe if st.local_gpus is None else None,
                              # Watched as a remote agent's (docs/architecture.md,
                              # "GPUs that fall sick").
                              gpu_health=GpuHealth(load_pynvml, st.data_dir / "agent" /
                                                   "gpu_health.json")
                              if hw.source == "nvml" else None),
        ))
        await self.agent.start()
        await self.agent.run()

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
        if self._agent_task is not None:
            self._agent_task.cancel()  # stop() shuts it down (engines per the settings)
        if self._elector is not None:
            self._stepping_down = asyncio.create_task(self._step_down(), name="step-down")
            self._tasks.append(self._stepping_down)

    async def _step_down(self) -> None:
        for t in self._leading:
            t.cancel()
        await asyncio.gather(*self._leading, return_exceptions=True)
        await self.elector.step_down()

    async def stop(self) -> None:
        self.closing.set()
        wait = 2 * self.settings.etcd_timeout + self.settings.election_interval
        if self._stepping_down is not None:  # not cancelled: it gives up the lead
            await ended([self._stepping_down], wait, "giving up the lead")
        for t in self._tasks:
            t.cancel()
        await ended(self._tasks, wait, "being cancelled")
        if self.agent is not None:
            await self.agent.shutdown()
        if self._elector is not None:
            await self._elector.resign()
        if self.adapters is not None:
            await self.adapters.close()
        if self._mirror is not None:
            await self._mirror.stop()
        await self.proxy.stop()
        if self.tracer is not None:  # the last spans, sent off the event loop
            await asyncio.to_thread(self.tracer.shutdown)
        if self._store is not None:
            await self._store.close()
        logger.info("gateway %s stopped", self.settings.gateway_id)


async def _wait_http(url: str, tls: ssl.SSLContext | None, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls or True)) as session:
        while loop.time() < deadline:
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s")
