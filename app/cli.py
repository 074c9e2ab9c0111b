"""The `llmgw` command: `serve`, `agent` and `ctl`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.control.keys import node_token
from app.control.state import check_name
from app.settings import Settings


def _node_name(value: str) -> str:
    """argparse type: node names follow the rule of model names (state.py)."""
    try:
        return check_name(value, "node name")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _settings(**overrides: object) -> Settings:
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "settings"
            print(f"llmgw: invalid setting {loc}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.main import create_app

    settings = _settings(host=args.host, port=args.port)
    app = create_app(settings)
    gateway = app.state.gateway

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # Before uvicorn waits for open requests: end the agents' long
            # polls (they move to another gateway) and the in-process agent's
            # loops, so a clean stop does not sit out the grace period.
            gateway.begin_shutdown()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    Server(config).run()


def agent(args: argparse.Namespace) -> None:
    from app.agent.agent import Agent, AgentConfig
    from app.agent.engines import available_engines, resolve_vllm
    from app.agent.gpus import declared, discover

    token = os.environ.get("LLMGW_AGENT_TOKEN", "")
    if not token:
        print("llmgw agent: set LLMGW_AGENT_TOKEN (from `llmgw ctl node-token NODE`)",
              file=sys.stderr)
        raise SystemExit(2)
    vllm_env = os.environ.get("LLMGW_VLLM_BIN", "")
    gpus = declared(args.gpus) if args.gpus is not None else discover()
    cfg = AgentConfig(
        gateways=[u for u in args.gateway.split(",") if u], node=args.node, token=token,
        gpus=gpus, engines=available_engines(gpus, vllm_env),
        work_dir=Path(args.work_dir or Path.home() / ".local/share/llmgw-agent" / args.node),
        vllm_bin=resolve_vllm(vllm_env), advertise_host=args.advertise_host or "",
        stop_engines_on_exit=args.stop_engines_on_exit,
    )

    async def main() -> None:
        a = Agent(cfg)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        # Before start(): a stop during adoption must still be a clean one.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await a.start()
            await a.run()
        except asyncio.CancelledError:
            pass
        finally:
            await a.shutdown()

    logging.getLogger(__name__).info(
        "agent for node %s: %d GPUs, engines %s", cfg.node, len(gpus), cfg.engines)
    asyncio.run(main())


def ctl(args: argparse.Namespace) -> None:
    if args.ctl == "node-token":
        secret = os.environ.get("LLMGW_SECRET", "")
        if not secret:
            data_dir = Path(os.environ.get("LLMGW_DATA_DIR", "~/.local/share/llmgw"))
            path = data_dir.expanduser() / "secret"
            if not path.exists():
                print("llmgw ctl: set LLMGW_SECRET", file=sys.stderr)
                raise SystemExit(2)
            secret = path.read_text().strip()
        print(node_token(secret, args.node))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("serve", help="run a gateway (all-in-one without LLMGW_ETCD_ENDPOINTS)")
    sp.add_argument("--host", default=None)
    sp.add_argument("--port", type=int, default=None)
    sp.set_defaults(func=serve)

    ap = sub.add_parser("agent", help="run a node agent")
    ap.add_argument("--gateway", required=True, help="gateway URL(s), comma-separated")
    ap.add_argument("--node", required=True, type=_node_name)
    ap.add_argument("--gpus", type=int, default=None,
                    help="declare N GPUs instead of discovering them")
    ap.add_argument("--advertise-host", default=None,
                    help="address engines are reported at (default: the local address "
                    "of this host's route to the gateway)")
    ap.add_argument("--work-dir", default=None,
                    help="engine logs and the record of running engines")
    ap.add_argument("--stop-engines-on-exit", action="store_true",
                    help="stop this node's engines when the agent stops (default: leave "
                    "them running; the next agent run adopts them)")
    ap.set_defaults(func=agent)

    cp = sub.add_parser("ctl", help="operator commands")
    csub = cp.add_subparsers(dest="ctl", required=True)
    nt = csub.add_parser("node-token", help="print the agent token for a node")
    nt.add_argument("node", type=_node_name)
    cp.set_defaults(func=ctl)

    args = p.parse_args(argv)
    _logging(args.log_level)
    args.func(args)


if __name__ == "__main__":
    main()
