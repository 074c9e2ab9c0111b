"""The agent's own small HTTP API: its node's logs and model cache.

Gateways call it on an admin's behalf (app/api/nodes.py); nothing else
should. It listens on the agent's advertised address, on `api_port` (0: any
free port), and the agent reports its URL in the node's inventory
(`api_url`). Every request must carry the node's token, the one the agent
presents to gateways (LLMGW_AGENT_TOKEN), which gateways derive from the
shared secret (app/control/keys.py): a gateway needs no other credential,
and a token taken from one node opens that node's API only.

    GET    /node/v1/logs?source=agent|REPLICA&lines=N   recent lines, and the sources
    GET    /node/v1/loads                               its engines' load figures (loads.py)
    GET    /node/v1/weights                             the model cache's entries
    DELETE /node/v1/weights  {"paths": [...]}           removes entries (all or none)
    POST   /node/v1/fabric/ticket|send|sink             fabric test (app/agent/fabric.py)
    POST   /node/v1/upgrade  {"version", "sha256"}      installs llmgw, restarts (upgrade.py)

Errors are RFC 9457 problem JSON, like the gateways' /admin. Log lines are
returned with every engine key and key-shaped string masked
(app/wire/masking.py; DESIGN invariant 6 in docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from app import __version__
from app.agent import fabric, logfiles, upgrade, weights
from app.agent.engines import EngineSpec
from app.agent.loads import LoadGatherer
from app.wire import loads as loadwire
from app.wire.fabric import SINK_PATH
from app.wire.masking import mask

logger = logging.getLogger(__name__)

AGENT_SOURCE = "agent"
MAX_LINES = 10_000
MAX_PATHS = 1000


class NodeView(Protocol):
    """What the API needs from the agent: the engines it runs or is assigned."""

    def engine_specs(self) -> list[EngineSpec]: ...


@dataclass(frozen=True)
class NodeApiConfig:
    node: str
    token: str
    work_dir: Path
    cache_dir: Path
    log_keep: int = 3

    @property
    def agent_log(self) -> Path:
        return self.work_dir / "agent.log"

    @property
    def engine_logs(self) -> Path:
        return self.work_dir / "logs"


class _Problem(Exception):
    def __init__(self, status: int, title: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail, self.extra = status, title, detail, extra


def _problem(status: int, title: str, detail: str, **extra: Any) -> web.Response:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    return web.json_response(body, status=status, content_type="application/problem+json")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class NodeApi:
    def __init__(self, cfg: NodeApiConfig, view: NodeView,
                 loads: LoadGatherer | None = None) -> None:
        self.cfg = cfg
        self.view = view
        # The engines' figures gateways read instead of every engine's
        # /metrics; None: answered with no figures.
        self.loads = loads
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.fabric = fabric.Fabric()
        # Set by the agent's command (app/cli.py), which can re-execute it.
        self.upgrader: upgrade.Upgrader | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=1 << 20)
        app.router.add_get("/node/v1/logs", self.logs)
        app.router.add_get(loadwire.LOADS_PATH, self.engine_loads)
        app.router.add_get("/node/v1/weights", self.list_weights)
        app.router.add_delete("/node/v1/weights", self.delete_weights)
        app.router.add_post("/node/v1/upgrade", self.upgrade)
        fabric.routes(self.fabric, app, _problem)
        return app

    async def start(self, host: str, port: int) -> str:
        """Serves on host:port (0: a free one); returns the URL to report."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
        logger.info("node API of %s at %s", self.cfg.node, self.url)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        presented = auth[7:] if auth.startswith("Bearer ") else ""
        if request.path == SINK_PATH:
            # A sink ticket, not the node token: the sending agent must not
            # learn this node's token (app/agent/fabric.py). Spent here, once.
            if not self.fabric.take(presented):
                return _problem(401, "Unauthorized", "send 'Authorization: Bearer <a sink "
                                "ticket of this node>', unused and under a minute old")
        elif not presented or not hmac.compare_digest(presented.encode(), self.cfg.token.encode()):
            return _problem(401, "Unauthorized",
                            f"send 'Authorization: Bearer <node token of {self.cfg.node}>'")
        try:
            return await handler(request)
        except _Problem as exc:
            return _problem(exc.status, exc.title, exc.detail, **exc.extra)
        except web.HTTPException as exc:  # aiohttp's own 404/405
            return _problem(exc.status, exc.reason, exc.text or exc.reason)
        except Exception:
            logger.exception("node API: %s %s failed", request.method, request.path)
            return _problem(500, "Internal error", "see the agent's log")

    # --- logs ------------------------------------------------------------------------

    def sources(self) -> dict[str, Path]:
        """Log name -> file: the agent's, and each engine log on disk (those
        of replicas stopped since included, until removed)."""
        found = {AGENT_SOURCE: self.cfg.agent_log}
        try:
            for path in sorted(self.cfg.engine_logs.glob("*.log")):
                found.setdefault(path.stem, path)
        except OSError:
            pass
        return found

    async def logs(self, request: web.Request) -> web.Response:
        raw = request.query.get("lines", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_LINES:
            raise _Problem(400, "Bad lines", f"lines must be 1 to {MAX_LINES}, not {raw!r}")
        source = request.query.get("source", AGENT_SOURCE)
        sources = self.sources()
        if source not in sources:
            raise _Problem(404, "No such log", f"node {self.cfg.node} has no log {source!r}",
                           sources=sorted(sources))
        lines = await asyncio.to_thread(logfiles.tail, sources[source], int(raw),
                                        self.cfg.log_keep)
        secrets = [s.key for s in self.view.engine_specs()] + [self.cfg.token]
        return web.json_response({
            "node": self.cfg.node, "source": source, "sources": sorted(sources),
            "lines": [mask(line, secrets) for line in lines],
        })

    # --- engine loads (loads.py) ----------------------------------------------------------

    async def engine_loads(self, request: web.Request) -> web.Response:
        figures = self.loads.figures() if self.loads is not None else {}
        return web.json_response(loadwire.loads_answer(self.cfg.node, figures))

    # --- cached weights -----------------------------------------------------------------

    def _in_use(self) -> Callable[[], dict[Path, list[str]]]:
        """What the replicas' weights occupy, to compute in a worker thread:
        it walks their folders for links (weights.in_use_paths)."""
        by_weights: dict[str, list[str]] = {}
        for spec in self.view.engine_specs():
            by_weights.setdefault(spec.weights, []).append(spec.replica_id)
        return lambda: weights.in_use_paths(self.cfg.cache_dir, by_weights)

    async def list_weights(self, request: web.Request) -> web.Response:
        in_use = self._in_use()
        try:
            entries = await asyncio.to_thread(
                lambda: weights.listing(self.cfg.cache_dir, in_use()))
        except OSError as exc:  # not a folder, no permission
            logger.warning("model cache %s unreadable: %s", self.cfg.cache_dir, exc)
            raise _Problem(500, "Cache unreadable", f"{self.cfg.cache_dir}: {exc}") from None
        return web.json_response({"node": self.cfg.node, "cache_dir": str(self.cfg.cache_dir),
                                  "entries": [e.as_dict() for e in entries]})

    async def delete_weights(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise _Problem(400, "Bad body", 'send JSON: {"paths": ["..."]}') from None
        paths = body.get("paths") if isinstance(body, dict) else None
        if (not isinstance(paths, list) or not 1 <= len(paths) <= MAX_PATHS
                or not all(isinstance(p, str) for p in paths)):
            raise _Problem(400, "Bad body",
                           f'send {{"paths": [...]}}: 1 to {MAX_PATHS} paths as strings')
        try:
            in_use = self._in_use()
            removed = await asyncio.to_thread(
                lambda: weights.remove(self.cfg.cache_dir, paths, in_use()))
        except weights.Refused as exc:
            title = {404: "No such path", 409: "Weights in use"}.get(exc.status, "Path refused")
            raise _Problem(exc.status, title, f"{exc.path!r}: {exc.reason}; "
                           f"{weights.said_removed(exc.removed)}",
                           path=exc.path, removed=exc.removed) from None
        except weights.RemovalFailed as exc:  # no permission, a disk error
            logger.error("removing %r from the model cache failed: %s; %s", exc.path,
                         exc.error, weights.said_removed(exc.removed), exc_info=exc.error)
            raise _Problem(500, "Removal failed", f"{exc.path!r}: {exc.error}; it may be "
                           f"partly removed; {weights.said_removed(exc.removed)}: list the "
                           "cache again", path=exc.path, removed=exc.removed) from None
        except OSError as exc:  # reading the cache, before anything was removed
            logger.exception("checking %s in the model cache failed", paths)
            raise _Problem(500, "Removal failed", f"{exc}; nothing removed") from None
        logger.info("removed from the model cache: %s", ", ".join(removed))
        return web.json_response({"node": self.cfg.node, "removed": removed})

    # --- self-upgrade (upgrade.py) --------------------------------------------------------

    async def upgrade(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        version = body.get("version") if isinstance(body, dict) else None
        sha256 = body.get("sha256") if isinstance(body, dict) else None
        if not isinstance(version, str) or not isinstance(sha256, str):
            raise _Problem(400, "Bad body", 'send JSON: {"version": "X.Y.Z", '
                           '"sha256": "<the wheel\'s>"}')
        if isinstance(body, dict) and body.get("index_url") is not None:
            raise _Problem(400, "Bad body", "index_url is not taken: upgrades come only from "
                           f"this node's {upgrade.SOURCE_SETTING}")
        if self.upgrader is None:
            raise _Problem(501, "Upgrade not available",
                           "this agent was not started by `llmgw agent`: it cannot restart")
        try:
            lines = await self.upgrader.upgrade(version, sha256)
        except upgrade.UpgradeError as exc:
            raise _Problem(exc.status, exc.title, exc.detail, output=exc.output) from None
        return web.json_response({"node": self.cfg.node, "from": __version__,
                                  "version": version, "restarting": True, "output": lines})
