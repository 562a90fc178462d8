"""trainyard_runtime: what a service needs to run, on top of the contract.

The bus (faststream/aiokafka wiring, dead letters, dedup), the outbox, the Redis store and its keyspace,
epoch-fenced leases, replication and failover, the service lifecycle (``ServiceRuntime``) and the metrics
server. Ranks never import it: ``trainyard_contract`` is all a training environment installs.
"""
