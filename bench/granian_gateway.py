#!/usr/bin/env python3
"""llmgw's gateway served by granian instead of uvicorn, for the benchmarks'
side-by-side runs (bench/router_overhead.py and bench/streams.py, target
`llmgw-granian`); settings from the environment, as `llmgw serve` takes them.

Not how llmgw is run: `llmgw serve` keeps uvicorn (bench/RESULTS.md,
"Server: granian beside uvicorn", says why). What granian does not take from
llmgw here: the gateway's own HTTP/1.1 protocol and its slow-client cuts
(app/gateway/http1.py), the stop's notice and grace (app/cli.py), `--workers`' shared
socket, and the arrival stamp (the proxy then stamps the request itself, a
step later).

    python bench/granian_gateway.py --port 8080 [--interface asgi] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def app() -> object:
    """granian's factory: the gateway's ASGI app, its settings from LLMGW_*."""
    from app.gateway import fdlimit
    from app.gateway.main import create_app
    from app.gateway.settings import Settings

    fdlimit.raise_soft()
    return create_app(Settings())  # type: ignore[call-arg]  # from LLMGW_* (pydantic-settings)


def main(argv: list[str] | None = None) -> int:
    from granian import Granian
    from granian.constants import Interfaces, Loops

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backlog", type=int, default=2048)
    args = p.parse_args(argv)
    Granian(
        "granian_gateway:app", factory=True, address=args.host, port=args.port,
        interface=Interfaces.ASGI, loop=Loops.uvloop, workers=1,
        # One Rust runtime thread beside the Python one: the proxy is held
        # to one core (taskset) like every other here.
        runtime_threads=1, backlog=args.backlog, log_enabled=False,
        working_dir=Path(__file__).resolve().parent,
    ).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
