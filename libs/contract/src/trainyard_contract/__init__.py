"""trainyard_contract: what every party agrees on, and nothing that talks to a broker or Redis.

Events and topics (``events``), records (``records``), the training spec and catalog (``spec``,
``catalog``), manifests, exit codes and reasons (``exitcodes``, ``exitreasons``), the spool and wire formats,
the storage layout, settings parsing and trace context. It depends on pydantic (and fsspec, pyyaml, opentelemetry-api)
only, so a rank's environment, a data pipeline or a client installs it without faststream, aiokafka, redis or
prometheus-client; those belong to ``trainyard_runtime``.
"""
