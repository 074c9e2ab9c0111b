"""llmgw: one OpenAI-compatible endpoint over a fleet of GPU nodes.

Gateways (`llmgw serve`) share their state in etcd and route /v1 requests
to engines (vLLM, llama.cpp) that agents (`llmgw agent`) start on the
nodes; `llmgw ctl` is the operator's command over the admin API. The
packages are layered, each importing only those below it (import-linter,
pyproject.toml): cli; gateway and api; control, agent and ctl; router and
store; wire, tls, logs, compiled and ports (docs/architecture.md, "Folders: the
packages").

- `agent/`: the node agent: reports its node, runs the engines assigned to it
- `api/`: the gateway's HTTP API besides /v1: /admin, /agent/v1, the cluster page, /docs
- `cli`: the `llmgw` command: `serve`, `stop`, `agent` and `ctl`
- `compiled`: the router and the server protocol compiled by mypyc, while they match the source
- `control/`: the control plane: the mirrored state, the leader's placement, admin writes
- `ctl/`: `llmgw ctl`, the operator's commands over the admin API
- `gateway/`: the gateway process: its parts assembled, settings, workers, metrics
- `logs`: how every llmgw process logs
- `ports`: a free port for a process that binds it later, outside the ephemeral range
- `router/`: /v1: a request's key, limits, choice of replica and relay
- `store/`: the shared state's store: etcd, and the contract every store keeps
- `tls`: TLS on the gateway's port, and the contexts its clients verify it with
- `wire/`: what travels between llmgw's processes (agent API bodies, the model spec)
"""

__version__ = "0.1.0"
