"""The store: the gateways' shared state behind one contract, `Store`
(base.py), with etcd's meaning of keys, revisions, leases and watches.

Two implementations keep it: `EtcdStore` (etcd/, for a fleet of gateways)
and `EmbeddedStore` (embedded.py, SQLite, for one gateway alone). The
gateway opens one at start (`open_store`, app/gateway/) and hands it to the
control plane (app/control/: the mirror's watch, the leader's election and
passes, the operations behind the admin and agent APIs) and to the gateway's
own loops (key shares, metrics); they see only `Store` and its typed errors,
never which store they have. One contract suite (tests/test_store_contract.py)
runs against both.

The rule it keeps: failures are typed (`StoreUnavailable` is a 503,
`StoreFull` a store out of space, `LeaseExpired` a dead lease), a store's
`health()` never does I/O, and nothing here imports the control plane, the
router or the gateway (import-linter, pyproject.toml).

- `base`: the contract: `Store`, its values (`KeyValue`, `Event`,
  `WatchBatch`, `Compare`, `Put`, `Delete`) and its typed errors
- `embedded`: `EmbeddedStore`, the contract on one SQLite file, with leases
  and watches in memory
- `sqlite`: the embedded store's SQLite plumbing: the schema, opening the
  file, SQLite's errors as the store's
- `health`: `HealthTracker`, a store's reachability told by its calls'
  outcomes, each change logged once
- `etcd/`: `EtcdStore`, the contract on etcd v3: its calls, watcher,
  connection, key space, channel, endpoints and TLS
"""
