"""The API's routes, one ``APIRouter`` module per OpenAPI tag (``admin``, wide, is split by what it
administers: nodes, tenants and tokens, the audit log, the caller's own token). ``create_app`` includes
them in the order their paths are matched and documented."""
