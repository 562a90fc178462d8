"""One way for a command to talk to the API, and one translation of its errors into exit codes.

    with api_session(config) as client:      # config: the global --api-url / --token (CliConfig)
        client.submit(...)

Every trainyard error ends the command with a one-line message (a refused spec: each field on its
line) and an exit code: 2 for a configuration problem (no token, a bad URL), 1 for everything the API
refused or could not do. httpx and the API's JSON stay inside :mod:`client`, which raises the tree
of ``trainyard_contract.errors``; this is the edge where they become what a shell sees.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer

from trainyard_contract.errors import ConfigError, TrainyardError

from trainyard_cli.client import ApiClient, ApiSpecError
from trainyard_cli.config import CliConfig
from trainyard_cli.console import error, stderr
from trainyard_cli.render import field_problems

EXIT_REFUSED = 1
EXIT_CONFIG = 2


@contextmanager
def api_session(config: CliConfig, *, admin: bool = False, what: str = "spec") -> Iterator[ApiClient]:
    """An API client with the token (``admin``: the admin token); errors become a message and an exit code."""
    try:
        with ApiClient(config.api_url, config.require_admin_token() if admin else config.require_token()) as client:
            yield client
    except ApiSpecError as exc:
        stderr().print(field_problems(exc.problems, what), end="")
        raise typer.Exit(EXIT_REFUSED) from None
    except ConfigError as exc:
        error(exc.message)
        raise typer.Exit(EXIT_CONFIG) from None
    except TrainyardError as exc:  # the API's words, brackets and all (console.py)
        error(exc.message)
        raise typer.Exit(EXIT_REFUSED) from None
