"""The control plane: the fleet's shared state in the store, the copy every
gateway keeps of it, and what the leader decides from it.

Every gateway mirrors the whole store (mirror.py) and answers from that
copy; one of them, the leader (leader.py, fenced on a lease), reconciles:
its pass (plan/) compares the catalog with the replicas and writes what to
create, drain and delete (reconciler.py). Where a replica goes is
placement's decision (placement/), one pure function of the mirrored state,
so any gateway says what the leader decides. The HTTP handlers write
through ops/. It never imports the router (import-linter, pyproject.toml):
app/gateway/publish.py is where the two meet.

- `adapters`: where each LoRA adapter is loaded: the leader's adapter loop
- `catalog`: the catalog file, seeding, export
- `compaction`: the leader compacts the store's history
- `gpuhealth`: sick GPUs as the gateways see them, and an admin's clear
- `key_usage`: client key usage, written in batches
- `keyfiles`: provider key files: where they may lie and how they are read
- `keys`: keys derived from the shared secret, and client key hashing
- `leader`: leader election on a store lease, with fencing
- `mirror`: a watch-fed copy of the whole store, kept by every gateway
- `ops/`: the control plane's writes, as operations the HTTP handlers call
- `placement/`: where one more replica goes, and why nowhere (the verdict, as data)
- `plan/`: the leader's reconcile pass as a pure function, and load-based scaling
- `reconciler`: the leader's loop: read the mirror, plan, apply the plan fenced
- `state`: the shared state: key layout and the JSON shapes stored under each key
- `storeid`: the store's id: what tells one store's revisions from another's
- `usage`: usage snapshots: what each gateway's router is doing, for the leader
"""
