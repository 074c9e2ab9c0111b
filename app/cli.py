"""The `llmgw` command: `serve`, `stop`, `agent` and `ctl`."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from app.logs import configure
from app.logs import stop as stop_logging
from app.wire.names import check_name

if TYPE_CHECKING:
    # Imported by the gateway's commands only: the agent and ctl load none of
    # the control plane or the store (docs/architecture.md, "Processes").
    import asyncio

    from app.gateway.settings import Settings

# Seconds between the cut at the end of a stop's grace period and uvicorn
# cancelling what is still open: time for cut streams to send their error event.
_CUT_SLACK = 5.0


def _node_name(value: str) -> str:
    """argparse type: node names follow the rule of model names (app/wire/names.py)."""
    try:
        return check_name(value, "node name")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(value: str) -> float:
    """Seconds, finite and > 0 (argparse applies it to an environment
    default too): nan and inf are refused."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return seconds


def _stop_wait(notice: str, grace: str) -> float:
    """What a stop of the gateway may take: the notice and grace periods,
    then the cut's slack (docs/design/stopping.md)."""
    try:
        return float(notice) + float(grace) + _CUT_SLACK
    except ValueError:
        return 3 + 600 + _CUT_SLACK


def _default_data_dir() -> str:
    """The gateway's LLMGW_DATA_DIR default (app/gateway/settings/store.py), named
    without loading the gateway's settings (tests/test_process_imports.py
    checks the two agree)."""
    return str(Path.home() / ".local/share/llmgw")


def _settings(**overrides: object) -> Settings:
    from pydantic import ValidationError

    from app.gateway.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "settings"
            print(f"llmgw: invalid setting {loc}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(args: argparse.Namespace) -> None:
    from app.gateway import pidfile, workers

    if args.worker is not None:  # started by the supervisor below
        workers.die_with_parent(args.supervisor)
        workers.tag_logs(args.worker)
        sock = socket.socket(fileno=args.listen_fd)
        # Its last lines written before uvicorn ends it with the signal.
        _serve(args, _settings(), stop_logging, sock=sock, campaign=args.worker == 0,
               ready_first=workers.READY_FIRST if args.restart else 0.0,
               worker=(args.worker, args.of))
        return
    settings = _settings(host=args.host, port=args.port, workers=args.workers)
    try:
        n = workers.count(settings)
    except workers.Refused as exc:
        print(f"llmgw serve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        # DATA_DIR/llmgw.pid, locked while this gateway runs (`llmgw stop`).
        held = pidfile.hold(settings.data_dir)
    except pidfile.AlreadyRunning as exc:
        print(f"llmgw serve: a gateway (pid {exc.pid}) is already running on "
              f"{settings.data_dir}; `llmgw stop` stops it", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as exc:
        print(f"llmgw serve: cannot write {settings.data_dir / pidfile.NAME}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        if n == 1:
            def stopped() -> None:
                # Next, uvicorn raises the signal it caught again and the
                # process ends without its exit handlers: the pid file goes,
                # and the queued log lines are written, before that.
                held.release()
                stop_logging()
            _serve(args, settings, stopped)
        else:
            workers.supervise(args.log_level, args.log_format, settings, n, held.release)
    finally:
        held.release()


def _serve(args: argparse.Namespace, settings: Settings, stopped: Callable[[], None],
           sock: socket.socket | None = None, campaign: bool = True,
           ready_first: float = 0.0, worker: tuple[int, int] | None = None) -> None:
    import uvicorn

    from app.gateway import fdlimit
    from app.gateway.http1 import protocol
    from app.gateway.main import create_app
    from app.gateway.server import StoppingServer

    fdlimit.raise_soft()
    app = create_app(settings, campaign=campaign, ready_first=ready_first, worker=worker)
    grace = settings.shutdown_grace_seconds
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            # Its loggers propagate to ours (app/logs.py), so
                            # they take LLMGW_LOG_FORMAT; its access log stays
                            # off: the router writes its own (app.access).
                            log_config=None, log_level=args.log_level, access_log=False,
                            # A backstop: the cut (StoppingServer) ends /v1 requests at
                            # `grace`; whatever is still open after this is
                            # cancelled without a word.
                            timeout_graceful_shutdown=int(grace + _CUT_SLACK),
                            # Our HTTP/1.1 protocol, cutting slow clients
                            # (app/gateway/http1.py): a factory, which uvicorn
                            # calls as it calls a protocol class.
                            http=cast("type[asyncio.Protocol]", protocol(
                                settings.header_timeout, settings.body_timeout)),
                            # uvloop, taking a burst of connections in a turn
                            # (app/gateway/accept.py).
                            loop="app.gateway.accept:Loop",
                            timeout_keep_alive=settings.keep_alive_timeout,
                            # X-Forwarded-* are read for the admin API and the
                            # pages only (GatewayApp): not a step of every /v1
                            # request. And no "server: uvicorn" on every answer:
                            # a header less through uvicorn's checks, the
                            # implementation not advertised.
                            proxy_headers=False, server_header=False,
                            # Checked at start (Settings): both or neither.
                            ssl_certfile=settings.tls_cert_file,
                            ssl_keyfile=settings.tls_key_file)
    server = StoppingServer(config, app.state.gateway, settings, stopped)
    server.run(sockets=None if sock is None else [sock])


def stop(args: argparse.Namespace) -> None:
    from app.gateway import pidfile

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    raise SystemExit(pidfile.stop(Path(args.data_dir).expanduser(), args.timeout, say))


def agent(args: argparse.Namespace) -> None:
    from app.agent.command import run

    run(args)


def ctl(args: argparse.Namespace) -> None:
    from app.ctl import run

    run(args.rest)


def parser() -> argparse.ArgumentParser:
    """`llmgw`'s commands and options (ctl's own are typer's)."""
    p = argparse.ArgumentParser(prog="llmgw", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "info"))
    p.add_argument("--log-format",
                   default=os.environ.get("LLMGW_LOG_FORMAT", "text"),
                   help="text (lines) or json (one object a line; default: %(default)s)")
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("serve", help="run a gateway (all-in-one without LLMGW_ETCD_ENDPOINTS)")
    sp.add_argument("--host", default=None)
    sp.add_argument("--port", type=int, default=None)
    sp.add_argument("--workers", type=int, default=None,
                    help="processes serving the port (LLMGW_WORKERS; default: the cores "
                    "available with etcd, 1 on the embedded store)")
    # A worker of a supervisor (app/gateway/workers.py): not for operators.
    sp.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    sp.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)  # the workers in all
    sp.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    sp.add_argument("--supervisor", type=int, default=None, help=argparse.SUPPRESS)
    sp.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)
    sp.set_defaults(func=serve)

    stp = sub.add_parser("stop", help="stop the gateway running on a data dir (SIGTERM to "
                         "the pid in DATA_DIR/llmgw.pid), waiting for it to exit")
    stp.add_argument("--data-dir", default=os.environ.get("LLMGW_DATA_DIR")
                     or _default_data_dir(),
                     help="the gateway's LLMGW_DATA_DIR (default: %(default)s)")
    notice = os.environ.get("LLMGW_SHUTDOWN_NOTICE_SECONDS", "3")
    grace = os.environ.get("LLMGW_SHUTDOWN_GRACE_SECONDS", "600")
    stp.add_argument("--timeout", type=_positive,
                     default=_stop_wait(notice, grace),
                     help="seconds to wait for it to exit; exit status 1 past them "
                     "(default: the notice and grace periods and %(default)s in all)")
    stp.set_defaults(func=stop)

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
    ap.add_argument("--api-port", type=int,
                    default=int(os.environ.get("LLMGW_AGENT_API_PORT", "0")),
                    help="port of the agent's own API (logs, cached weights) on the "
                    "advertised address; 0: any free port, reported to the gateways")
    ap.add_argument("--cache-dir", default=os.environ.get("LLMGW_AGENT_CACHE_DIR") or None,
                    help="the model cache the API lists and prunes (default: "
                    "huggingface_hub's: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)")
    ap.add_argument("--upgrade-source",
                    default=os.environ.get("LLMGW_AGENT_UPGRADE_SOURCE", ""),
                    help="where self-upgrades come from: a package index URL (credentials "
                    "in it or in ~/.netrc; never shown) or an absolute path to a folder of "
                    "wheels; empty (the default): upgrades are refused")
    ap.add_argument("--upgrade-timeout", type=_positive,
                    default=os.environ.get("LLMGW_AGENT_UPGRADE_TIMEOUT", "300"),
                    help="seconds each pip run of an upgrade may take (default: %(default)s)")
    ap.add_argument("--start-timeout", type=_positive,
                    default=os.environ.get("LLMGW_ENGINE_START_TIMEOUT", "1800"),
                    help="seconds an engine may load before it is stopped and counted as "
                    "a death (default: %(default)s; large weights download and load slowly)")
    ap.set_defaults(func=agent)

    cp = sub.add_parser("ctl", help="operator commands (`llmgw ctl --help`)", add_help=False)
    cp.add_argument("rest", nargs=argparse.REMAINDER)
    cp.set_defaults(func=ctl)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ctl"]:
        # typer parses ctl's own options (`--json`, `--gateway`) wherever they stand.
        from app.ctl import run

        run(argv[1:])
        return
    p = parser()
    args = p.parse_args(argv)
    try:
        configure(args.log_level, args.log_format)
    except ValueError as exc:
        p.error(str(exc))
    args.func(args)


if __name__ == "__main__":
    main()
