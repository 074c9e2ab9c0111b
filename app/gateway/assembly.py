"""The composition root: `build_gateway(settings)` builds one whole gateway,
and lists what its supervisor starts, in order
(docs/architecture.md, "Processes"; docs/design/stopping.md).

Nothing here runs at import time and nothing is global, so a test can build
three differently configured gateways in one process. The parts that need
the store are built when it opens, at the first service's start
(`_connect`); every other service reads them from there. The supervisor
stops the services in reverse: the app's loops, the last key usage
written, the local agent, the gateway's loops, the lead, the lease, the
mirror, the router's upstreams, the tracer, the store.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

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
from app.control.compaction import Compactor
from app.control.key_usage import KeyUsageWriter
from app.control.keyfiles import ProviderKeys, own_files
from app.control.keys import SecretRing, hash_client_key
from app.control.leader import Elector
from app.control.mirror import Mirror
from app.control.placement.agentversion import default_window
from app.control.reconciler import Reconciler, ReconcileSettings
from app.control.usage import UsagePublisher
from app.gateway.gateway import Control, Gateway
from app.gateway.gc_keeper import thresholds
from app.gateway.key_shares import Holder, KeyShares, claim_floors
from app.gateway.metrics import GatewayMetrics
from app.gateway.node_agents import NodeAgents
from app.gateway.observers import Observers
from app.gateway.publish import Publisher, Timing
from app.gateway.request_series import RequestSeries
from app.gateway.router_usage import LastUse, RouterUsage
from app.gateway.settings import Settings
from app.gateway.supervisor import Leadership, Service, Supervisor
from app.gateway.worker_loads import WorkerLoads
from app.gateway.worker_metrics import WorkerMetrics
from app.router.proxy import Proxy, ProxyOptions
from app.router.responses import tag_keys
from app.router.table import RouteTable
from app.router.timeouts import Timeouts
from app.store.base import Store, StoreUnavailable
from app.tls import pinned_context
from app.wire.tokens import node_token

logger = logging.getLogger(__name__)

StoreFactory = Callable[[Settings], Awaitable[Store]]
# Seconds between a worker's writes of its request figures (worker_metrics.py):
# what the others' /metrics lag behind it by, at most, between scrapes.
WORKER_METRICS_INTERVAL = 2.0


async def open_store(settings: Settings) -> Store:
    if settings.uses_etcd:
        from app.store.etcd.store import EtcdStore
        from app.store.etcd.tls import for_endpoints

        tls = for_endpoints(settings.endpoints, settings.etcd_ca_file, settings.etcd_cert_file,
                            settings.etcd_key_file)
        return await EtcdStore.open(settings.endpoints, prefix=settings.etcd_prefix,
                                    timeout=settings.etcd_timeout, tls=tls)
    from app.store.embedded import EmbeddedStore

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return await EmbeddedStore.open(settings.data_dir / "state.db")


def build_gateway(settings: Settings, *, campaign: bool = True, ready_first: float = 0.0,
                  worker: tuple[int, int] | None = None,
                  store_factory: StoreFactory = open_store) -> Gateway:
    """`campaign=False`: a gateway's worker other than its first, which
    holds a lease but never leads; `ready_first`: a restarted worker, which
    waits up to that many seconds for its mirror before its port takes
    connections, so the other workers answer them meanwhile; `worker`:
    (index, count) of a worker of `llmgw serve --workers`, whose /metrics
    is the gateway's (docs/design/workers.md)."""
    if not settings.uses_etcd:
        settings.ensure_local_secrets()
    assert settings.secret is not None and settings.admin_token is not None, (
        "LLMGW_SECRET and LLMGW_ADMIN_TOKEN must be set with etcd"
    )
    gw = Gateway(settings)
    gw.agent_window = default_window(settings.min_agent_version)
    # Every engine key and node token goes through it: during a rotation
    # it derives from the previous secret too (keys.SecretRing).
    prev = settings.previous_secret
    gw.secrets = SecretRing(settings.secret.get_secret_value(),
                            prev.get_secret_value() if prev else None)
    gw.admin_token = settings.admin_token.get_secret_value()
    # External models' key files, read off the loop
    # (docs/design/security.md, "Files an admin names").
    gw.provider_keys = ProviderKeys(settings.provider_key_dir, own_files(
        settings.data_dir, [v for _, v in settings if isinstance(v, Path)]))
    gw.table = RouteTable()
    gw.metrics = GatewayMetrics(gw)
    _router(gw)
    _workers(gw, worker)
    gw.supervisor = Supervisor(wait=2 * settings.etcd_timeout + settings.election_interval)
    # Leader only: started and stopped by the elector (supervisor.py, `Leadership`).
    gw.leadership = Leadership([
        ("reconciler", lambda: gw.built.reconciler.run()),
        ("adapters", lambda: gw.built.adapters.run(settings.reconcile_interval)),
        # docs/design/security-operations.md, "A month of uptime".
        ("compaction", lambda: gw.built.compactor.run()),
    ] if campaign else [])
    gw.supervisor.add(*_services(gw, store_factory, campaign), *_app_services(gw, ready_first))
    return gw


def _router(gw: Gateway) -> None:
    """The router and what it reports each request's end to."""
    st = gw.settings
    # Notes each model's last use for the usage snapshots, counts the
    # request in the last minutes' series (the cluster page's charts), then
    # in the metrics (observers.py).
    gw.last_use, gw.series = LastUse(), RequestSeries()
    observers = Observers([gw.last_use, gw.series, gw.metrics.requests])
    gw.tracer = None
    if st.otlp_endpoint:  # imported only then: zero cost when unset
        from app.router.tracing import otlp_tracer

        gw.tracer = otlp_tracer(st.otlp_endpoint, st.gateway_id)
    gw.proxy = Proxy(gw.table, hash_client_key, Timeouts(
        connect=st.connect_timeout, first_byte=st.first_byte_timeout,
        idle=st.stream_idle_timeout, request=st.request_timeout,
        cooldown=st.replica_cooldown, cold_start=st.cold_start_timeout,
        cold_start_held=st.cold_start_max_held, spill_hold=st.spill_hold),
        observer=observers, tracer=gw.tracer, options=ProxyOptions(
            affinity=st.router_affinity, count_concurrency=st.prompt_count_concurrency,
            count_timeout=st.prompt_count_timeout,
            response_keys=tag_keys(gw.secrets.current, gw.secrets.previous)))


def _workers(gw: Gateway, worker: tuple[int, int] | None) -> None:
    """Under `llmgw serve --workers N`: what worker `index` of `count` shares
    with the others (docs/design/workers.md)."""
    gw.worker_metrics = None
    if worker is None or worker[1] <= 1:
        return
    st, (index, count) = gw.settings, worker
    gw.worker_metrics = WorkerMetrics(gw.metrics.requests, st.data_dir, index, count)
    # The engine-load poll split among the workers, not repeated by each.
    gw.proxy.loads.share = WorkerLoads(st.data_dir, index, count)
    # No floor on a key's limits but the gateway's one: N counts gateways.
    gw.proxy.limits.floor, gw.proxy.limits.lapsed_floor = claim_floors(index)
    gw.metrics.gateway_id = st.gateway_id.removesuffix(f"-w{index}") if index else st.gateway_id


def _services(gw: Gateway, store_factory: StoreFactory, campaign: bool) -> list[Service]:
    """The gateway's services, in the order they start; they stop in
    reverse (docs/design/stopping.md)."""
    st = gw.settings
    campaigns = [Service("election-campaign", run=lambda: _every(
        gw, gw.elector.campaign, "campaign", lambda: st.election_interval))] if campaign else []
    agent = [Service("local-agent", run=lambda: _local_agent(gw),
                     stop=lambda: _shut_agent(gw))] if st.local_agent else []
    return [
        Service("store", start=lambda: _connect(gw, store_factory),
                stop=lambda: gw.store.close()),
        Service("tracer", stop=lambda: _shut_tracer(gw)),
        Service("router", start=gw.proxy.start, stop=gw.proxy.stop),
        # Loads in the background, retrying while the store is unreachable;
        # /readyz says no until it has.
        Service("mirror", start=lambda: _now(gw.mirror.start), stop=lambda: gw.mirror.stop()),
        Service("adapters-client", stop=lambda: gw.built.adapters.close()),
        Service("lease", stop=lambda: gw.elector.resign()),
        Service("leadership", stop=gw.stop_leading),
        gw.supervisor.follow_ups(),
        # Two loops: a renewal never waits behind a campaign stuck on a
        # slow store (docs/design/control-plane.md, "Election").
        *campaigns,
        Service("election-renew", run=lambda: _every(
            gw, gw.elector.renew, "renewal",
            # A held lease at its pace; none (lost, or not yet granted) at once.
            lambda: st.renew_interval if gw.elector.lease else st.election_interval)),
        Service("publisher", run=lambda: gw.built.publisher.run(st.publish_interval)),
        Service("usage", run=lambda: gw.built.usage.run(st.usage_interval)),
        Service("key-shares", run=lambda: gw.built.key_shares.run(st.key_share_interval)),
        *agent,
    ]


def _app_services(gw: Gateway, ready_first: float) -> list[Service]:
    """What only the process serving the app runs, after the gateway's."""
    st, out = gw.settings, []
    if ready_first:  # the mirror's first load (revision > 0), or the bound
        out.append(Service("ready-first", start=lambda: _first_load(gw, ready_first),
                           serving=True))
    if st.gc_threshold:
        out += [Service("gc-freeze", start=lambda: _now(lambda: _gc_threshold(gw)),
                        run=lambda: _freeze_after_load(gw), serving=True),
                Service("gc-keeper", run=gw.metrics.gc.run, serving=True)]
    out.append(Service("key-usage", run=lambda: gw.built.key_usage.run(st.key_usage_interval),
                       stop=lambda: _last_usage(gw), serving=True))
    summed = gw.worker_metrics
    if summed is not None:
        out.append(Service("worker-metrics", run=lambda: summed.run(WORKER_METRICS_INTERVAL),
                           serving=True))
    loop = gw.metrics.loop
    return [*out, Service("loop-lag", start=lambda: _now(loop.watch_gc), run=loop.run,
                          stop=lambda: _now(loop.unwatch_gc), serving=True)]


async def _connect(gw: Gateway, store_factory: StoreFactory) -> None:
    """Opens the store and builds the parts that need it, in this order:
    the publisher subscribes to the mirror before it loads."""
    st = gw.settings
    store = await store_factory(st)
    if st.catalog_file is not None:
        await _seed(gw, store, catalog.load_file(st.catalog_file, st.model_root_list,
                                                 st.provider_key_dir))
    # In the background: with the store down, start must not wait on it.
    gw.spawn(_claim_store_id(store), "store-id")
    mirror = Mirror(store)
    publisher = Publisher(mirror, gw.table, gw.secrets, gw.agent_window, gw.provider_keys,
                          gateway_id=st.gateway_id,
                          # An agent heartbeats at least every third of the
                          # node TTL: a key gone with its agent alive is back
                          # within two heartbeats (the first may still find
                          # the store coming back; app/gateway/node_grace.py).
                          timing=Timing(node_grace=st.node_ttl / 2 + 2))
    info = s.GatewayInfo(id=st.gateway_id, url=st.public_url, version=__version__,
                         started=time.time(), secret=gw.secrets.current_id)
    elector = Elector(store, info, st.lease_ttl, mirror=mirror,
                      on_started_leading=gw.leadership.started,
                      on_stopped_leading=gw.leadership.stopped)
    reconciler = Reconciler(store, mirror, elector, ReconcileSettings(
        drain_seconds=st.drain_seconds, interval=st.reconcile_interval,
        node_grace=st.node_grace, idle_slack=st.usage_refresh + st.usage_interval,
        scale_down_window=st.scale_down_window, default_load_target=st.default_load_target,
        saturated_after=st.saturated_after, agent_window=gw.agent_window),
        secrets=gw.secrets)
    adapters = AdapterLoop(store, mirror, elector, gw.secrets,
                           shrink_after=st.adapter_shrink_after, drain=st.drain_seconds)
    usage = UsagePublisher(store, mirror, RouterUsage(gw.table, gw.last_use, publisher),
                           st.gateway_id, lambda: elector.lease, refresh=st.usage_refresh)
    compactor = Compactor(store, lambda: elector.is_leader,
                          lambda: mirror.revision if mirror.ready else 0,
                          st.etcd_compaction_interval)
    # Engine loads come from each node's agent (docs/design/routing.md, "Choosing a replica").
    gw.proxy.loads.directory = NodeAgents(mirror, gw.secrets)
    key_shares = KeyShares(store, mirror, gw.proxy.limits, Holder(
        st.gateway_id, lambda: elector.lease, lambda: elector.proven_until(st.lease_ttl),
        st.lease_ttl), refresh=st.key_share_interval)
    key_shares.start()
    gw.control = Control(store, mirror, elector, publisher, reconciler, adapters, usage,
                         compactor, key_shares,
                         KeyUsageWriter(store, mirror, st.gateway_id, gw.proxy.limits))


async def _seed(gw: Gateway, store: Store, models: dict[str, s.ModelSpec],
                retry: float = 0.0) -> None:
    """Seeds the catalog from LLMGW_CATALOG_FILE if the store has none.

    Tried once before the mirror loads, so that its first load has the
    catalog; with the store unreachable, retried in the background (the
    gateway serves meanwhile, as it would without a file)."""
    st = gw.settings
    if retry:
        await asyncio.sleep(retry)
    try:
        done = await catalog.seed(store, models, st.gateway_id, time.time())
    except StoreUnavailable as exc:
        logger.debug("catalog seed deferred, store unavailable: %s", exc)
        gw.spawn(_seed(gw, store, models, retry=min(max(2 * retry, 0.5), 10.0)),
                 "catalog-seed")
        return
    if done:
        logger.info("seeded the catalog with %d models from %s (gateway %s)", len(models),
                    st.catalog_file, st.gateway_id)
    else:
        logger.info("catalog already in the store: %s not used", st.catalog_file)


async def _claim_store_id(store: Store) -> None:
    """Creates the store's id if it has none (app/control/storeid.py),
    retrying while the store is unreachable. Until the mirror has it,
    agents are answered without one and compare revisions within their
    run only, as with a gateway older than store ids."""
    retry = 0.5
    while True:
        try:
            found = await storeid.ensure(store, time.time())
        except StoreUnavailable as exc:
            logger.debug("store id deferred, store unavailable: %s", exc)
            await asyncio.sleep(retry)
            retry = min(2 * retry, 10.0)
            continue
        logger.info("store id %s", found)
        return


async def _every(gw: Gateway, step: Callable[[], Awaitable[None]], what: str,
                 every: Callable[[], float]) -> None:
    while True:
        try:
            await step()
        except Exception:
            # The steps handle store failures; anything else is a bug, but
            # the loop must outlive it or this gateway never leads again.
            logger.exception("election %s crashed", what)
        await asyncio.sleep(every())


async def _now(call: Callable[[], object]) -> None:
    """A service's start or stop that is a plain call."""
    call()


async def _shut_tracer(gw: Gateway) -> None:
    if gw.tracer is not None:  # the last spans, sent off the event loop
        await asyncio.to_thread(gw.tracer.shutdown)


async def _shut_agent(gw: Gateway) -> None:
    if gw.agent is not None:  # engines stopped or not, per the settings
        await gw.agent.shutdown()


async def _first_load(gw: Gateway, bound: float) -> None:
    await gw.mirror.wait_past(0, bound)


def _gc_threshold(gw: Gateway) -> None:
    # Everything built so far lives as long as the gateway: frozen, the
    # collector never walks it again (settings.gc_threshold).
    gw.metrics.gc.freeze_all()
    gc.set_threshold(*thresholds(gw.settings.gc_threshold))


async def _freeze_after_load(gw: Gateway) -> None:
    """The mirror's first load, in the background, is most of what a gateway
    keeps for good (10,000 nodes: ~200 MiB parsed): frozen too, once, or
    every full collection walks it, GIL held, the router stalled behind it
    (~270 ms at 10,000 nodes, bench/control_scale.py). And frozen again
    after each full collection, as the mirror's values are replaced
    (app/gateway/gc_keeper.py)."""
    while not await gw.mirror.wait_past(0, 60.0):
        pass
    gw.metrics.gc.freeze_all()


async def _last_usage(gw: Gateway) -> None:
    await gw.proxy.stop_counting()  # counts still running: estimated, then written
    try:  # the last counts: a clean stop loses none while the store answers
        await asyncio.wait_for(gw.built.key_usage.flush(), gw.settings.etcd_timeout)
    except Exception:
        logger.exception("last key usage write failed")


async def _local_agent(gw: Gateway) -> None:
    """All-in-one mode: an agent in this process, reaching us over loopback."""
    st = gw.settings
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
    gw.agent = Agent(AgentConfig(
        gateways=[url], node=st.local_node, token=node_token(gw.secrets.current, st.local_node),
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
                          # Watched as a remote agent's (docs/design/gpu-health.md).
                          gpu_health=GpuHealth(load_pynvml, st.data_dir / "agent" /
                                               "gpu_health.json")
                          if hw.source == "nvml" else None),
    ))
    await gw.agent.start()
    await gw.agent.run()


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
