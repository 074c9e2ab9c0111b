"""What travels between llmgw's processes: the shapes and rules a gateway,
an agent and `llmgw ctl` must agree on.

Nothing here imports anything else of llmgw (checked by import-linter,
pyproject.toml), so the agent and `llmgw ctl` import this and never the
control plane: a change to the leader's own types is not a change to the
agent's protocol (docs/architecture.md, "Folders: the packages").

- `adapters`: LoRA adapters in the catalog: what they name and change on their base
- `catalog`: the catalog's rules across a spec's fields and across the whole catalog
- `engine_routes`: what llmgw adds to the engines it starts (a llama.cpp chat's prompt count)
- `fabric`: the fabric test's contract: the sink's path and the most a test may ask
- `loads`: engine load figures, as vLLM's /metrics and an agent's `/node/v1/loads` give them
- `masking`: secrets masked out of text that leaves a process (log lines)
- `names`: how a model, alias, node or profile may be spelled; the engines and phases
- `nodes`: the agent API's bodies: a node's inventory, its GPUs, a replica's status
- `spec`: the model spec an operator PUTs at /admin/models/{name}
- `tokens`: the node token's derivation from the shared secret
- `versions`: how versions compare (vLLM builds, agents' versions)
"""
