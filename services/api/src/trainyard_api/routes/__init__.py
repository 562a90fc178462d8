"""The API's routes, one ``APIRouter`` module per OpenAPI tag (``admin``, wide, is split by what it
administers: nodes, tenants and tokens, the audit log, the caller's own token, the cluster's topology;
``jobs`` keeps what the dashboard reads, metric history, logs and live updates, in ``dashboard``).
``create_app`` includes them in the order their paths are matched and documented."""
