"""Redis ACL users of the local stack: one per service, an operator for people's tools; no anonymous clients.

``make up`` generates the passwords once (``<state dir>/redis-users.json``, mode 0600), writes the
ACL file redis-server loads (``--aclfile``) and hands each service the URL of its own user. The
``default`` user has a random password and no ``nopass``, so a connection without credentials (a
training script probing the control plane) is refused (NOAUTH); ranks are given no Redis URL at all
(node agent: admission.rank_env). It keeps every permission on purpose: redis-server replays the
AOF as the default user, and a restricted (or ``off``) default user makes it refuse the replayed
MULTI/EXEC blocks at start-up (NOPERM): every transaction since the last rewrite would be lost.

A service user's rules are generated from the keyspace declaration (:mod:`trainyard_runtime.keyspace`):
it may write the key families it owns, read the ones it is a named reader of, use the bus's doorbell
channel, and run no command of ``@dangerous`` (FLUSHALL, CONFIG, KEYS, SHUTDOWN, DEBUG, ACL, …). The
node agent, on hosts that run untrusted code, writes only its own ``ty:agent:*`` keys and its beacons.
The users are the declaration's services; the operator may do everything. Pure except
:func:`load_or_create` and :func:`write_acl_file`.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote

from trainyard_runtime import keyspace

SERVICE_USERS = keyspace.SERVICES
OPERATOR = keyspace.OPERATOR  # the CLI's `dev` commands, tests, people's redis-cli
DEFAULT = "default"  # never handed out; a password so that no client is authenticated without one
OPERATOR_RULES = "~* &* +@all"


def rules_for(user: str) -> str:
    """``user``'s ACL rules: everything for the operator and default, the keyspace's for a service, and
    nothing for a name neither knows (a user left in an older passwords file)."""
    if user in (OPERATOR, DEFAULT):
        return OPERATOR_RULES
    if user in SERVICE_USERS:
        return keyspace.acl_rules(user)
    return "resetkeys resetchannels -@all"


def acl_text(passwords: dict[str, str]) -> str:
    """The ACL file for ``passwords`` (user → password)."""
    return "".join(f"user {user} on >{passwords[user]} {rules_for(user)}\n" for user in sorted(passwords))


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
