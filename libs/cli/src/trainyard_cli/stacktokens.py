"""The local stack's tokens: the platform-admin token the API bootstraps (``<state dir>/admin-token``) and the
developer's token (``<state dir>/dev-token``, tenant-admin of tenant ``dev``), issued through the API with
the first. Nothing here writes Redis: a token is what the API answers."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainyard_contract.errors import InfrastructureError

__all__ = ["DEV_TENANT", "DevTokens", "first_line"]

DEV_TENANT = "dev"


class DevTokens:
    """The two token files of one stack's state directory."""

    def __init__(self, root: Path) -> None:
        self.token_file = root / "dev-token"
        self.admin_token_file = root / "admin-token"  # TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE

    def when_the_api_answers(self, api_url: str, timeout_s: float = 60.0) -> str:
        """:meth:`ensure`, retried while the API is unreachable or answers 5xx (it may still be connecting to
        the broker right after it turned healthy); other errors at once."""
        from trainyard_cli.client import ApiError

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.ensure(api_url)
            except ApiError as exc:
                transient = exc.status is None or exc.status >= 500
                if not transient or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def ensure(self, api_url: str) -> str:
        """The dev token: the file's while the API accepts it, else a new one issued through the API with the
        bootstrap admin token."""
        from trainyard_cli.client import ApiAuthError, ApiClient, ApiConflictError

        token = first_line(self.token_file)
        if token:
            with ApiClient(api_url, token) as api:
                try:
                    api.list_jobs(limit=1)
                    return token
                except ApiAuthError:
                    pass  # unknown (a fresh Redis), revoked or expired: issue another
        admin = first_line(self.admin_token_file)
        if not admin:
            raise InfrastructureError(
                f"the API accepts no dev token and wrote no admin token to {self.admin_token_file}; an active "
                "platform-admin token exists elsewhere: issue the dev token with it (`trainyard --token <admin> "
                f"admin tokens create --tenant {DEV_TENANT} --role tenant-admin > {self.token_file}`)",
                retryable=False)
        with ApiClient(api_url, admin) as api:
            try:
                api.call_json("POST", "/v1/admin/tenants", body={"tenant": DEV_TENANT})
            except ApiConflictError:
                pass  # exists already
            issued = api.call_json("POST", f"/v1/admin/tenants/{DEV_TENANT}/tokens",
                                   body={"name": "dev", "role": "tenant-admin"})
        write_private(self.token_file, issued["token"])
        return str(issued["token"])


def first_line(path: Path) -> str:
    try:
        return path.read_text().strip().split("\n", 1)[0].strip()
    except OSError:
        return ""


def write_private(path: Path, secret: str) -> None:
    """``secret`` into ``path``, readable by its owner only from the moment it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    path.chmod(0o600)
