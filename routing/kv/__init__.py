"""The KV router: the prefix-block index and its events, per-worker load, scoring and selection,
session affinity, the decision itself (`router`) and the lease that owns a decided request's
reservation (`lease`).

Imported by the frontend. A worker imports only `events` (to publish what its cache stores and
evicts) and `load` (to mark prefill done); it never imports `router`, `selection` or `lease`.
"""
