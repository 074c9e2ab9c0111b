"""The gateway's HTTP API besides /v1: the admin API (`/admin`), the API
agents call (`/agent/v1`), the cluster page and the docs.

Mounted by the gateway (app/gateway/main.py create_app), which hands each
route module the few parts it reads and writes through (deps.py), never the
whole gateway. Writes are the control plane's operations (app/control/ops/);
their refusals, and any bad input, are answered as RFC 9457 problems, never
a 500. A route that needs the mirror answers 503 until it has loaded
(DESIGN invariant 9: answer only from state you have).

- `admin`: `/admin` catalog (models, export), leader, gateways, nodes, routes, replicas
- `agent`: `/agent/v1/nodes/{node}`: heartbeats, assignments (a long poll), replica statuses
- `auth`: the admin token's bearer check, one dependency for every /admin router
- `cluster`: the cluster page at /cluster
- `deps`: the interfaces route modules are handed instead of the gateway
- `docs`: Swagger UI at /docs, served from this process
- `edge`: what every request outside /v1 passes before FastAPI sees it
- `errors`: error shapes (OpenAI's on /v1, problems elsewhere) and their handlers
- `fabric`: `/admin` fabric test, TCP bandwidth between nodes' agents
- `fleet`: `/admin` node cordon, drain, pool, labels, engine build, GPU faults; quotas
- `keys`: `/admin/keys`: client keys and their usage
- `nodes`: `/admin` routes that reach a node's agent: logs, model cache, upgrade
- `openapi`: what /admin and /agent/v1 answer besides 200, in the OpenAPI document
- `refusals`: the control plane's refusals as problems, one status and title each
- `stats`: `GET /admin/stats`: each model's last minutes of traffic
- `writes`: when an admin write may be applied: ETag preconditions and deadlines
"""
