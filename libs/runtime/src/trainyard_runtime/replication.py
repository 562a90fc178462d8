"""Reaching Redis — one server, or a primary that Sentinel fails over — and making an epoch
increment survive that failover (docs/design.md §5.2.1).

URLs (``TRAINYARD_REDIS_URL``):

* ``redis://[user:password@]host:port/db`` (``rediss://``, ``unix://``): one server.
* ``redis+sentinel://[user:password@]host:port[,host:port…]/service[/db]``: ask these Sentinels for
  the primary of ``service``. The client follows a failover: a connection that meets a dead primary,
  or a demoted one (READONLY), is made again to whichever server the Sentinels name now, and the
  command is retried (:data:`SENTINEL_RETRY`). The user and password are the data servers'.

Query parameters, on either kind (taken off before the rest goes to redis-py):

* ``epoch_acks``: how many replicas must acknowledge an epoch increment before it is used (WAIT).
  Default 1 with Sentinel, 0 for one server (which needs none: AOF ``appendfsync always``).
  With more than one replica set it to the number of replicas (see §5.2.1).
* ``epoch_ack_timeout_ms``: how long to wait for them (default 1000); then the increment is not
  used and the caller gets a retryable :class:`~trainyard_contract.errors.EpochNotReplicatedError`.
* ``sentinel_username``, ``sentinel_password``: the Sentinels' own credentials, if they ask for any.

Replication is asynchronous, so a failover loses the primary's last writes. Redis cannot run WAIT
inside a script, so :func:`eval_durably` sends the script and ``WAIT`` in one pipeline: one
connection, hence one server, and WAIT covers everything that connection wrote. An epoch is
returned only when a replica holds it; the replica Sentinel promotes then has it too.

The same rule holds for every write the platform acknowledges to a user or another service (a 202, a
READY, a control request, a revocation, an event the outbox relays): :func:`execute_confirmed` runs its
MULTI with one more command, ``SET`` of a one-off token key, then ``DEL token`` + ``WAIT`` in one pipeline.
WAIT inside a MULTI does not block, and after the MULTI the connection goes back to the pool, so the
token carries the proof instead: the DEL finds it only on a server that has the whole MULTI (it is
atomic), and the replica that acknowledges the DEL has everything before it in that server's replication
stream — the MULTI included — whichever server the client reached after a failover. No token: the
failover lost the write; too few acknowledgements: it may yet be lost. Either is a retryable
:class:`~trainyard_contract.errors.WriteNotReplicatedError`, and nothing is acknowledged.
:func:`confirm_replicated` does the same for what a caller has read (an idempotent replay answers with
a record only once a replica holds it). One server (``epoch_acks`` 0): none of this, no extra command.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import AbstractBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from trainyard_contract.errors import ConfigError, EpochNotReplicatedError, WriteNotReplicatedError
from trainyard_runtime.retry import RetryPolicy

__all__ = ["SENTINEL_SCHEME", "EpochAcks", "RedisTarget", "StateRedis", "confirm_replicated", "connect",
           "epoch_acks", "eval_durably", "execute_confirmed", "parse_redis_url", "undecoded", "write_confirmed"]

SENTINEL_SCHEME = "redis+sentinel"

#: Standalone: a command that meets a dead connection is tried again on a fresh one, three more times within
#: about 0.7 s (0.1, 0.2, 0.4 s). After a Redis restart every pooled connection is dead, and each one used to
#: fail the first command sent over it, seconds later: a shard report retried after a back-off, late enough for
#: its checkpoint to be fenced (chaos seed 1796110550, job-21f429ec888b).
STANDALONE_RETRY = RetryPolicy(initial_interval_s=0.1, maximum_interval_s=0.5, maximum_attempts=4)
#: Through Sentinel: long enough to ride out a failover (down-after-milliseconds, the election, the
#: promotion, the Sentinels naming the new primary): 0.2, 0.4, 0.8, then 1 s, about 10 s in all.
SENTINEL_RETRY = RetryPolicy(initial_interval_s=0.2, maximum_interval_s=1.0, maximum_attempts=13)
#: How long a Sentinel or a new connection may take to answer before the next one is tried.
SENTINEL_CONNECT_TIMEOUT_S = 1.0

_OUR_PARAMS = ("epoch_acks", "epoch_ack_timeout_ms", "sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class EpochAcks:
    """How an epoch increment is made durable: WAIT for ``replicas`` within ``timeout_ms`` (0: no WAIT)."""

    replicas: int = 0
    timeout_ms: int = 1000


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``TRAINYARD_REDIS_URL``: ``url`` for one server, or Sentinels and a service name."""

    acks: EpochAcks
    url: str = ""  # one server: what redis-py gets (our query parameters taken off)
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)


def parse_redis_url(url: str) -> RedisTarget:
    """Pure: what ``url`` names (see the module docstring); a malformed URL is a ConfigError."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _OUR_PARAMS}
    rest = [(k, v) for k, v in query if k not in _OUR_PARAMS]
    sentinel = parts.scheme == SENTINEL_SCHEME
    acks = EpochAcks(replicas=_int(ours, "epoch_acks", 1 if sentinel else 0),
                     timeout_ms=_int(ours, "epoch_ack_timeout_ms", 1000))
    if not sentinel:
        return RedisTarget(acks=acks, url=urlunsplit(parts._replace(query=urlencode(rest))))
    credentials, _, hosts = parts.netloc.rpartition("@")
    user, _, password = credentials.partition(":")
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not path or len(path) > 2:
        raise ConfigError(f"TRAINYARD_REDIS_URL: a Sentinel URL is {SENTINEL_SCHEME}://[user:password@]host:port"
                          f"[,host:port…]/service[/db]; got {_without_password(url)}")
    try:
        sentinels = tuple(_host_port(h) for h in hosts.split(","))
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError as exc:
        raise ConfigError(f"TRAINYARD_REDIS_URL: {exc} in {_without_password(url)}") from exc
    return RedisTarget(acks=acks, sentinels=sentinels, service=unquote(path[0]), db=db,
                       username=unquote(user) or None, password=unquote(password) or None,
                       sentinel_username=ours.get("sentinel_username") or None,
                       sentinel_password=ours.get("sentinel_password") or None)


def _int(params: dict[str, str], name: str, default: int) -> int:
    try:
        value = int(params[name]) if name in params else default
    except ValueError:
        raise ConfigError(f"TRAINYARD_REDIS_URL: {name} must be a whole number, not {params[name]!r}") from None
    if value < 0:
        raise ConfigError(f"TRAINYARD_REDIS_URL: {name} must be 0 or more")
    return value


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"Sentinel address {text!r} is not host:port")
    return host.strip("[]"), int(port)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, hosts = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{hosts}"


class _FollowingConnection(SentinelManagedConnection):
    """A connection that asks the Sentinels where the primary is every time it (re)connects.

    redis-py's own reconnects inside a command's retries (``send_packed_command`` →
    ``connect_check_health``) go back to the address the connection had: to the demoted primary, which
    answers READONLY again until the retries run out (redis/redis-py#3874, open). Connecting through the
    Sentinel-aware :meth:`connect` first makes every retry go to the current primary.
    """

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await self.connect()
        await super().send_packed_command(command, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """A blocking command (XREAD BLOCK, BLPOP …) waiting on a primary that is demoted gets ``UNBLOCKED
        … (master -> replica?)``, a plain error that nothing retries, and the connection stays with the
        replica (reads there succeed, stale). Like READONLY (redis-py's :class:`SentinelManagedConnection`):
        disconnect, and raise a connection error, so that the command is retried on the new primary."""
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if self.connection_pool.is_master and str(exc).startswith("UNBLOCKED"):
                await self.disconnect()
                raise RedisConnectionError(f"the primary was demoted: {exc}") from exc
            raise


class StateRedis(Redis):
    """A Redis client that knows how epoch increments are made durable (:attr:`epoch_acks`) and, through
    Sentinel, closes its Sentinel connections with itself."""

    epoch_acks: EpochAcks = EpochAcks()
    sentinel: Sentinel | None = None  # type: ignore[assignment]  # shadows redis-py's SENTINEL command method

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel is not None:
            sentinel, self.sentinel = self.sentinel, None
            await sentinel.aclose()


class PolicyBackoff(AbstractBackoff):
    """redis-py's retry waiting as a :class:`~trainyard_runtime.retry.RetryPolicy` says."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return self.policy.delay(failures)


def redis_retry(policy: RetryPolicy) -> Retry:
    """redis-py's ``Retry`` for ``policy``: its retries are the attempts after the first."""
    if policy.maximum_attempts is None:
        raise ValueError("a Redis command's retry policy needs maximum_attempts")
    return Retry(PolicyBackoff(policy), policy.maximum_attempts - 1)


def connect(url: str) -> StateRedis:
    """A client for ``url`` (decoded responses, retried on connection errors; see the module docstring)."""
    target = parse_redis_url(url)
    common: dict[str, Any] = {
        "decode_responses": True, "health_check_interval": 10,
        "retry": redis_retry(SENTINEL_RETRY if target.is_sentinel else STANDALONE_RETRY),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    if not target.is_sentinel:
        client = cast(StateRedis, StateRedis.from_url(target.url, **common))  # from_url builds cls
    else:
        sentinel = Sentinel(
            list(target.sentinels),
            sentinel_kwargs={"socket_timeout": SENTINEL_CONNECT_TIMEOUT_S,
                             "socket_connect_timeout": SENTINEL_CONNECT_TIMEOUT_S,
                             "username": target.sentinel_username, "password": target.sentinel_password,
                             "decode_responses": True},
            username=target.username, password=target.password, db=target.db,
            socket_connect_timeout=SENTINEL_CONNECT_TIMEOUT_S, **common)
        client = cast(StateRedis, sentinel.master_for(target.service, redis_class=StateRedis,
                                                      connection_class=_FollowingConnection))
        client.sentinel = sentinel
    client.epoch_acks = target.acks
    return client


def undecoded(redis: Redis) -> Redis:
    """Another client to whatever ``redis`` reaches (one server, or the primary its Sentinels name, followed
    across failovers like ``redis``) whose responses are bytes, not decoded strings. It has its own
    connections (its ``aclose`` leaves ``redis`` and its Sentinels open).

    A Sentinel client's pool cannot be rebuilt from its ``connection_kwargs`` alone (it needs the service
    name and the Sentinels), so the copy is asked of the Sentinels."""
    pool = redis.connection_pool
    sentinel = getattr(redis, "sentinel", None)
    if isinstance(redis, StateRedis) and sentinel is not None:
        client = sentinel.master_for(pool.service_name, redis_class=StateRedis,  # type: ignore[attr-defined]  # a Sentinel pool's
                                     connection_class=_FollowingConnection, decode_responses=False)
        client.epoch_acks = redis.epoch_acks  # its own .sentinel stays None: closing it leaves the Sentinels open
        return client
    return Redis(connection_pool=type(pool)(**{**pool.connection_kwargs, "decode_responses": False}))


def epoch_acks(redis: Redis) -> EpochAcks:
    """The client's durability rule for epoch increments (none for a client not made by :func:`connect`)."""
    return getattr(redis, "epoch_acks", EpochAcks())


async def eval_durably(redis: Redis, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """Run ``script``; where the client's :func:`epoch_acks` asks for replicas, return its result only
    once that many replicas acknowledged every write this connection made (the script's included).

    Raises :class:`EpochNotReplicatedError` (retryable) when they did not within the timeout: the
    result must then not be used. A script error (a ResponseError) is raised as is.
    """
    acks = epoch_acks(redis)
    if acks.replicas == 0:
        return await script(keys=list(keys), args=list(args))
    # EVAL, not EVALSHA: the pipeline may be re-sent to a new primary that never loaded the script
    async with redis.pipeline(transaction=False) as pipe:
        pipe.eval(script.script, len(keys), *keys, *args)  # type: ignore[arg-type]  # registered from str
        pipe.wait(acks.replicas, acks.timeout_ms)
        result, acked = await pipe.execute(raise_on_error=False)
    if isinstance(result, Exception):
        raise result
    if isinstance(acked, Exception):
        raise acked
    if int(acked) < acks.replicas:
        raise EpochNotReplicatedError(
            f"an epoch increment ({result!r}) was acknowledged by {acked} of {acks.replicas} replica(s) within "
            f"{acks.timeout_ms} ms; it is not used (a failover could lose it). Retry once a replica is in sync")
    return result


#: A confirmation token outlives any plausible gap between its MULTI and its DEL; one whose DEL never came
#: (the process died in between) expires by itself.
CONFIRMATION_TTL_S = 600
BARRIER_KEY = "ty:replication:barrier"


def confirmation_key(token: str) -> str:
    return f"ty:replication:ack:{token}"


async def execute_confirmed(redis: Redis, pipe: Pipeline, *, raise_on_error: bool = True,
                            execute: Callable[[bool], Awaitable[list[Any]]] | None = None) -> list[Any]:
    """Execute ``pipe`` (a MULTI of ``redis``) and return its results once the replicas :func:`epoch_acks` asks
    for hold all of it (see the module docstring). Raises :class:`WriteNotReplicatedError` (retryable) when
    they do not within the timeout or a failover lost it: the write must then not be acknowledged.
    ``execute``: the pipeline's own execute, where the caller has wrapped ``pipe.execute``."""
    run = execute or pipe.execute
    acks = epoch_acks(redis)
    if acks.replicas == 0:
        return await run(raise_on_error)
    token = uuid.uuid4().hex
    pipe.set(confirmation_key(token), "1", ex=CONFIRMATION_TTL_S)
    results = await run(raise_on_error)
    async with redis.pipeline(transaction=False) as check:
        check.delete(confirmation_key(token))
        check.wait(acks.replicas, acks.timeout_ms)
        found, acked = await check.execute(raise_on_error=False)
    _raise_unless_confirmed(found, acked, acks, "a write")
    return list(results[:-1])


async def write_confirmed(redis: Redis, build: Callable[[Pipeline], object]) -> list[Any]:
    """One MULTI of the commands ``build`` queues on it, executed by :func:`execute_confirmed`: a single write
    the caller is about to acknowledge (``write_confirmed(r, lambda p: p.hset(key, field, value))``)."""
    async with redis.pipeline(transaction=True) as pipe:
        build(pipe)
        return await execute_confirmed(redis, pipe)


async def confirm_replicated(redis: Redis, *keys: str) -> None:
    """Return once the replicas :func:`epoch_acks` asks for hold ``keys`` as the primary has them now (an
    idempotent replay about to answer with what an earlier, maybe unconfirmed, request wrote). The read, a
    barrier write and WAIT go in one pipeline: one server, and the barrier follows what was read."""
    acks = epoch_acks(redis)
    if acks.replicas == 0 or not keys:
        return
    async with redis.pipeline(transaction=False) as check:
        check.exists(*keys)
        check.incr(BARRIER_KEY)
        check.wait(acks.replicas, acks.timeout_ms)
        found, barrier, acked = await check.execute(raise_on_error=False)
    if isinstance(barrier, Exception):
        raise barrier
    _raise_unless_confirmed(found, acked, acks, f"the record {keys[0]}", want=len(keys))


def _raise_unless_confirmed(found: Any, acked: Any, acks: EpochAcks, what: str, want: int = 1) -> None:
    for result in (found, acked):
        if isinstance(result, Exception):
            raise WriteNotReplicatedError(f"{what} could not be confirmed by a replica: {result!r}") from result
    if int(found) < want:
        raise WriteNotReplicatedError(f"{what} was lost in a Redis failover before a replica had it; retry")
    if int(acked) < acks.replicas:
        raise WriteNotReplicatedError(
            f"{what} was acknowledged by {acked} of {acks.replicas} replica(s) within {acks.timeout_ms} ms; "
            "it is not confirmed (a failover could lose it). Retry once a replica is in sync")
