"""``python -m trainyard_api`` / ``trainyard-api``: run the REST API, or issue an API token."""

from __future__ import annotations

import argparse
import asyncio
import sys

from trainyard_contract.errors import TrainyardError
from trainyard_runtime.service import configure_logging, run_main
from trainyard_contract.settings import load_settings, settings_help
from trainyard_contract.records import TokenRole
from trainyard_runtime.store import StateStore, connect_redis

from trainyard_api.auth import issue_token
from trainyard_api.roles import ROLES
from trainyard_api.server import ApiServer
from trainyard_api.settings import ApiSettings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainyard-api",
        description=(
            "The trainyard REST API: POST /v1/training-jobs and the job read models, with bearer-token "
            "auth per tenant. Runs the HTTP server (uvicorn) and the service runtime (Redis, the Kafka "
            "bus, the outbox relay, the triggers' consumer) in one process; SIGTERM stops both cleanly. The "
            "StepMetrics read models it serves are kept by trainyard-telemetry. OpenAPI docs at /docs."
        ),
        epilog=settings_help(ApiSettings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="{serve,token}")
    sub.add_parser("serve", help="run the API (the default)")
    token = sub.add_parser("token", help="issue an API token for a tenant and print it (only its hash is stored)")
    token.add_argument("--tenant", required=True, help="the tenant the token acts for")
    token.add_argument("--name", default="default", help="a label for the token (shown as submittedBy)")
    token.add_argument("--token", default=None, help="register this token instead of a random one")
    token.add_argument("--role", default="submitter", choices=list(ROLES),
                       help="what it may do (default submitter); the first platform-admin token is better made by "
                            "TRAINYARD_API_BOOTSTRAP_ADMIN_TOKEN_FILE, and the others through the API")
    return p


async def _issue(settings: ApiSettings, tenant: str, name: str, token: str | None, role: TokenRole) -> str:
    redis = connect_redis(settings.redis_url)
    try:
        return await issue_token(StateStore(redis), tenant, name, token, role=role)
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        settings = load_settings(ApiSettings)
    except TrainyardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(settings.log_level, "api")
    if args.command == "token":
        try:
            print(asyncio.run(_issue(settings, args.tenant, args.name, args.token, args.role)))
        except Exception as exc:  # noqa: BLE001 - a CLI answer, not a traceback
            print(f"error: cannot store the token in Redis at {settings.redis_url}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    run_main(lambda: ApiServer(settings).run())


if __name__ == "__main__":
    main()
