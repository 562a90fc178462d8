"""Redis ACL users of the local stack: one per service, an operator for people's tools; no anonymous clients.

``make up`` generates the passwords once (``<state dir>/redis-users.json``, mode 0600), writes the
ACL file redis-server loads (``--aclfile``) and hands each service the URL of its own user. The
``default`` user has a random password and no ``nopass``, so a connection without credentials (a
training script probing the control plane) is refused (NOAUTH); ranks are given no Redis URL at all
(node agent: admission.rank_env). It keeps every permission on purpose: redis-server replays the
AOF as the default user, and a restricted (or ``off``) default user makes it refuse the replayed
MULTI/EXEC blocks at start-up (NOPERM): every transaction since the last rewrite would be lost.

Service users may touch only trainyard's keys (``~ty:*``) and no command of ``@dangerous``
(FLUSHALL, CONFIG, KEYS, SHUTDOWN, DEBUG, ACL, …); the operator may do everything. Pure except
:func:`load_or_create`.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote

SERVICE_USERS = ("api", "scheduler", "node-agent", "checkpoint-coordinator", "registry")
OPERATOR = "operator"  # the CLI's `dev` commands, tests, people's redis-cli
DEFAULT = "default"  # never handed out; a password so that no client is authenticated without one
SERVICE_RULES = "~ty:* &* +@all -@dangerous"
OPERATOR_RULES = "~* &* +@all"


def acl_text(passwords: dict[str, str]) -> str:
    """The ACL file for ``passwords`` (user → password)."""
    lines = []
    for user in sorted(passwords):
        rules = OPERATOR_RULES if user in (OPERATOR, DEFAULT) else SERVICE_RULES
        lines.append(f"user {user} on >{passwords[user]} {rules}")
    return "\n".join(lines) + "\n"


def url_for(user: str, password: str, *, host: str, port: int, db: int = 0) -> str:
    return f"redis://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}/{db}"


def load_or_create(path: Path) -> dict[str, str]:
    """The stack's Redis passwords, generated on first use (a user added later gets one too)."""
    try:
        passwords = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        passwords = {}
    changed = False
    for user in (*SERVICE_USERS, OPERATOR, DEFAULT):
        if not isinstance(passwords.get(user), str) or not passwords[user]:
            passwords[user] = secrets.token_urlsafe(24)
            changed = True
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(passwords, f, indent=2)
        os.replace(tmp, path)
    return passwords


def write_acl_file(path: Path, passwords: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(acl_text(passwords))
    return path
