"""Connection and key-prefix plumbing shared by every module that owns a Redis key family.

Each key family is named in the module that owns it (index, load, registry, ...); this
module only provides the deployment-wide prefix, so one Redis can host several
deployments and the tests can work in a namespace of their own.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

DEFAULT_PREFIX = "mmr:"


def redact_url(url: str | None) -> str:
    """A Redis (or any) URL with its password replaced, safe to log or show."""
    if not url:
        return ""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, has_password, _password = userinfo.partition(":")
    # The host and port are kept as written: parsing the port would fail on a malformed one.
    auth = f"{user}:***@" if has_password else f"{user}@"
    return urlunsplit((parts.scheme, auth + hostport, parts.path, parts.query, parts.fragment))


_PASSWORD_IN_TEXT = re.compile(r"(\w+://[^:/@\s]*:)([^@\s]+)(@)")


def redact_text(text: str) -> str:
    """Any `scheme://user:password@` inside free text, with the password masked."""
    return _PASSWORD_IN_TEXT.sub(r"\1***\3", text)


def reply_text(value: bytes | str) -> str:
    """A Redis reply's string as text, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else value


# Bounded waits: a Redis that stops answering must fail a request, never hang it. Blocking
# reads (XREAD BLOCK, 1 s) stay under the socket timeout. `configure_timeouts` sets them from
# the deployment's REDIS_TIMEOUT_SECS (the web and worker apps call it at start-up).
CONNECT_TIMEOUT_S = 2.0
SOCKET_TIMEOUT_S = 5.0


def configure_timeouts(seconds: float) -> None:
    """Every later client waits at most this long for any one Redis operation."""
    global CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S
    SOCKET_TIMEOUT_S = seconds
    CONNECT_TIMEOUT_S = min(seconds, 2.0)


def _client_options(*, asyncio: bool = False) -> dict[str, object]:
    import redis
    import redis.asyncio.retry
    import redis.retry
    from redis.backoff import NoBackoff

    retry_class = redis.asyncio.retry.Retry if asyncio else redis.retry.Retry
    return {
        # A pooled connection the server dropped (a restart) fails at once with ConnectionError:
        # the command is retried once on a fresh connection. A timeout is never retried: a frozen
        # Redis must cost one timeout, not several (redis-py's default retries ten times).
        "retry": retry_class(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        "health_check_interval": 30,
        "socket_keepalive": True,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
    }


# --- generations ---------------------------------------------------------------------------------
# What processes keep in memory (verified API keys, the worker rows, image sizes) is kept under a
# generation in Redis that every change sets anew. A random token, not a counter: a Redis
# restarted without its data would count from nothing again and could repeat a generation
# something is still kept under.


def read_generation(client, key: str) -> bytes:  # client: redis.Redis
    """The generation at `key` now; a Redis without one (new, or restarted empty) gets a fresh
    one, which nothing can be kept under yet."""
    value = client.get(key)
    if value is None:
        client.set(key, _new_generation(), nx=True)
        value = client.get(key)
    return value if value is not None else b""


def renew_generation(client, key: str) -> None:  # client: redis.Redis
    """What is kept under the generation at `key` is stale from now on, in every process."""
    client.set(key, _new_generation())


def _new_generation() -> str:
    import secrets

    return secrets.token_hex(8)


_sync_clients: dict[tuple[str, float | None], object] = {}


def sync_client(url: str, *, timeout_s: float | None = None):  # -> redis.Redis
    """One connection pool per URL and process, shared by every thread. `timeout_s` shortens
    the waits below the deployment's for a read that only saves work (its caller does without
    it), so a frozen Redis costs the request that one short wait on top of its own timeout."""
    import redis

    client = _sync_clients.get((url, timeout_s))
    if client is None:
        options = _client_options()
        if timeout_s is not None:
            options["socket_timeout"] = min(SOCKET_TIMEOUT_S, timeout_s)
            options["socket_connect_timeout"] = min(CONNECT_TIMEOUT_S, timeout_s)
        client = redis.Redis.from_url(url, **options)
        _sync_clients[(url, timeout_s)] = client
    return client


_async_clients: dict[tuple[str, int], object] = {}


def async_client(url: str):  # -> redis.asyncio.Redis
    """An asyncio client bound to the running event loop (asyncio clients must not cross loops),
    whose commands can always be cancelled (`_keeping_cancellations`)."""
    import asyncio

    import redis.asyncio

    loop = asyncio.get_running_loop()
    key = (url, id(loop))
    client = _async_clients.get(key)
    if client is None:
        client = redis.asyncio.Redis.from_url(url, **_client_options(asyncio=True))
        pool = client.connection_pool
        pool.connection_class = _keeping_cancellations(pool.connection_class)
        _async_clients[key] = client
    return client


_cancellable_classes: dict[type, type] = {}


def _keeping_cancellations(connection_class: type) -> type:
    """`connection_class` (plain, TLS or Unix socket, as the URL chose) sending each command
    under `asyncio.timeout` instead of redis-py's `asyncio.wait_for`.

    On Python 3.11, `wait_for` returns its result when a cancellation comes as the awaited send
    completes, and the cancellation is lost: measured here, 273 of 400 cancellations of a task
    that runs commands in a loop. The frontend learns that a client went away only by such a
    cancellation (Django cancels the request's task), so a lost one left the worker generating
    the whole answer for nobody. `asyncio.timeout` keeps the cancellation (3.12's `wait_for` is
    built on it); the socket timeout bounds the send as before.
    """
    found = _cancellable_classes.get(connection_class)
    if found is None:
        found = _cancellable_classes[connection_class] = type(
            connection_class.__name__, (_SendsUnderTimeout, connection_class), {}
        )
    return found


class _SendsUnderTimeout:
    """The send of `_keeping_cancellations`' connection classes (a mixin before redis-py's)."""

    socket_timeout: float | None

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        import asyncio

        import redis

        timeout = self.socket_timeout
        if not timeout:  # no timeout: redis-py sends without wait_for
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        # Without a socket timeout redis-py sends directly; the one here bounds the whole send
        # (the connect and health check it may start included). One command at a time uses a
        # connection, so no other reader sees the timeout cleared.
        self.socket_timeout = None
        try:
            async with asyncio.timeout(timeout):
                await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except TimeoutError:  # redis-py has closed the connection on the cancellation
            raise redis.TimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = timeout
