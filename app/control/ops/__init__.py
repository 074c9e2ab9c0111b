"""The control plane's writes, as operations the HTTP handlers call
(docs/architecture.md, "Folders: the packages"): each takes plain values, writes to the
store conditioned on what it read, and returns a result or raises a typed
refusal (refusals.py). No HTTP here: app/api maps refusals to problems.

- `agent_ops`: what agents write: a node's heartbeat, its replicas' statuses
- `base`: what every operation writes through: the store and this gateway's mirror
- `catalog_ops`: catalog writes: a model put and a model delete
- `conditions`: when a write may be applied: preconditions and deadline, as plain values
- `key_ops`: client key writes: a key created, a key revoked
- `node_ops`: fleet writes: a node's conf, capacity quotas, fabric test results
- `refusals`: why an operation did not do what it was asked, typed
"""
