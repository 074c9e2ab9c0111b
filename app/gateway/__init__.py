"""The gateway process: one OpenAI-compatible endpoint over the fleet, its
admin API, and the control plane's loops, in one asyncio process (or N
workers of one, `llmgw serve --workers N`). docs/architecture.md, "Processes".

`app/cli.py` serves `main.create_app(settings)`. One function builds a
gateway from its settings (assembly.py, the composition root); one
supervisor (supervisor.py) starts its services in order and stops them in
reverse; the loops that only a leader runs start and stop with the lead.
The rule kept here: this package wires the control plane and the router,
which never import each other (DESIGN invariant 8); inside it, modules
import only those below them (import-linter, "layers inside the gateway's
package").

- `main`: the ASGI app: `/v1` straight to the proxy, the HTTP routes, the lifespan
- `assembly`: the composition root: `build_gateway(settings)` and its services' order
- `gateway`: one gateway's parts as the routes read them, and the first step of its stop
- `supervisor`: services started in order and stopped in reverse; the leader-only loops
- `observers`: the proxy's request observer, one call to each member of a list
- `publish`: the mirror made into the router's tables (catalog, endpoints, key grants)
- `replica_endpoints`: each replica's endpoint or why not, worked out again only where changed
- `node_grace`: nodes whose key just went, still routed for a heartbeat or so
- `node_agents`: each replica's node agent, for the router's engine-load poll
- `key_shares`: this gateway's claims on client keys' limits, the loop that moves them
- `router_usage`: the router as the usage publisher reads it; each model's last use
- `request_metrics`: the per-request figures of `/metrics`, counted on the request path
- `request_series`: the last minutes of each model's traffic, for the cluster page's charts
- `metrics`: the gateway's Prometheus registry: request figures and the fleet at scrape time
- `loop_lag`: how late the event loop runs, how long the collector holds it
- `gc_keeper`: keeps CPython's full collections from walking the mirror
- `stopping`: waiting for background tasks to end, never hanging on one
- `pause`: a loop's wait between its steps, which a wake ends early
- `settings/`: every setting, with its default and what changing it costs
- `workers`: `llmgw serve --workers N`: N processes on one port, and their supervisor process
- `worker_metrics`: `/metrics` under `--workers`: every worker's figures summed
- `worker_loads`: the engine-load poll split among the workers
- `private_files`: the folder of files the workers exchange, nothing planted followed
- `pidfile`: DATA_DIR/llmgw.pid, and `llmgw stop`
- `http1`: each client connection's HTTP/1.1 under uvicorn's server: requests parsed and
  handed to the app, answers written, time limits on a client's headers and a stalled body
- `server`: uvicorn's server as `llmgw serve` runs it: our stop on a signal, a tick a second
- `accept`: the event loop: uvloop, taking every waiting connection at once
- `fdlimit`: the limit on open files, raised to what the system allows
"""

# The compiled copy of `http1`, when one matches it (app/compiled.py).
from app.compiled import package_path

__path__ = package_path(__name__, __path__)
