"""The store contract (app/store/base.py) on etcd v3: what a fleet of
gateways shares. `EtcdStore` is built by the gateway's `open_store`
(app/gateway/assembly.py) when LLMGW_ETCD_ENDPOINTS is set; the settings check
the endpoints and TLS files with `endpoints` and `tls` at start. Nothing
else imports this package: the code above the store sees only `Store`.

The modules, from the top: the store uses the connection, the key space
and the watcher; the watcher uses the connection and the key space; the
connection uses the channel; nothing imports upwards (import-linter's
"layers inside the etcd store" contract, pyproject.toml).

- `store`: `EtcdStore`, the contract's calls: reads, paged ranges, writes,
  transactions, leases
- `watcher`: `Watcher`, `watch` as our own loop on etcd's Watch stream; it
  resumes after the last event delivered, so it never skips one
- `connection`: `EtcdConnection`, the channel's lifetime, each call's failure
  as a typed error, and the health the outcomes tell
- `keyspace`: `KeySpace`, keys under LLMGW_ETCD_PREFIX, and the contract's
  values as etcd's protobuf messages (pure)
- `errors`: which gRPC statuses mean an outage, a bad request, a full store,
  or a watch to reopen (`translated`)
- `channel`: `EtcdChannel`, gRPC channels on resolved addresses (host names,
  IPv6, one per host with TLS), rebuilt when the names move
- `endpoints`: LLMGW_ETCD_ENDPOINTS parsed and checked (pure), and the gRPC
  target they become
- `tls`: the TLS files, checked at start, and what a failed handshake means
  in words
"""
