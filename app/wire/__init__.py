"""What travels between llmgw's processes: the agent API's bodies (a node's
inventory, a replica's status; nodes.py), the model spec the admin API and
`llmgw ctl` exchange (spec.py) and the catalog's rules both apply
(catalog.py), how names are spelled (names.py), the node token's derivation
(tokens.py), how versions compare (versions.py), and an agent's answer on
its engines' loads (loads.py).

Nothing here imports anything else of llmgw (checked by import-linter,
pyproject.toml), so the agent and `llmgw ctl` import this and never the
control plane: a change to the leader's own types is not a change to the
agent's protocol (docs/architecture.md, "Folders").
"""
