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
    """An asyncio client bound to the running event loop (asyncio clients must not cross loops)."""
    import asyncio

    import redis.asyncio

    loop = asyncio.get_running_loop()
    key = (url, id(loop))
    client = _async_clients.get(key)
    if client is None:
        client = redis.asyncio.Redis.from_url(url, **_client_options(asyncio=True))
        _async_clients[key] = client
    return client
