"""One command on a connection of its own, past redis-py's per-command machinery.

redis-py 8 wraps every command in a pool lock, a retry closure and observability hooks: about
40 us a command on a 2-core machine, twice the loopback round trip itself and a tenth of a whole
routing decision. The router's scripts (decide, first token, release, renew) run once or more
per request, so they go through `DirectCommands` instead:

- connections are made with the client's own settings (address, db, password, TLS, timeouts,
  health checks) and kept idle in a deque, whose pop and append are atomic: concurrent threads
  each take their own connection, and no lock is held across a round trip;
- a reply that is an error (`ResponseError`, `NoScriptError`) leaves the connection usable;
  any other failure closes it, so a half-read reply is never read by the next caller;
- the platform client's retry policy (routing.state.redis_keys) is kept: a reused connection the
  server dropped (a restart, an idle timeout) fails with ConnectionError at once, and the
  command goes once more on a fresh connection; a timeout is never retried (a frozen Redis costs
  one timeout), nor is a fresh connection that fails (Redis is down: the caller answers);
- after a fork the parent's connections are dropped, never used (Celery's prefork pool).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import redis

# One command: its name, then its arguments, as `execute` takes them.
Command = tuple[Any, ...]


def raise_first_error(replies: Iterable[Any]) -> None:
    """Raise the first error reply among `replies` as `AsyncDirectCommands.replies` gives them
    (each in its place), if any."""
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply


class DirectCommands:
    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self._connect = functools.partial(pool.connection_class, **pool.connection_kwargs)
        self._idle: collections.deque = collections.deque()
        self._pid = os.getpid()

    def execute(self, *args: Any) -> Any:
        """Send one command and return its reply, as `client.execute_command` would."""
        if self._pid != os.getpid():
            # The parent's sockets: dropped without a shutdown (redis-py only shuts a socket
            # down in the process that opened it), never written to.
            self._idle = collections.deque()
            self._pid = os.getpid()
        try:
            connection, reused = self._idle.pop(), True
        except IndexError:
            connection, reused = self._connect(), False
        try:
            return self._round_trip(connection, args)
        except redis.ConnectionError:
            if not reused:
                raise
            connection = self._connect()
            return self._round_trip(connection, args)

    def _round_trip(self, connection: Any, args: tuple[Any, ...]) -> Any:
        """The reply; the connection goes back to the idle ones unless it failed mid-exchange."""
        try:
            connection.send_command(*args)
            reply = connection.read_response()
        except redis.ResponseError:
            # An error reply was read whole: the connection is in step, and stays in use.
            self._idle.append(connection)
            raise
        except BaseException:
            connection.disconnect()
            raise
        self._idle.append(connection)
        return reply

    def close(self) -> None:
        while self._idle:
            self._idle.pop().disconnect()


class ViaClient:
    """For a client without a plain connection pool (blocking, sentinel, cluster): its own path."""

    def __init__(self, client: Any) -> None:
        self.execute = client.execute_command


_by_client: weakref.WeakKeyDictionary[Any, DirectCommands | ViaClient] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def direct_commands(client: Any) -> DirectCommands | ViaClient:
    """The client's direct line, made on first use and shared by every script on that client."""
    direct = _by_client.get(client)
    if direct is None:
        with _lock:
            direct = _by_client.get(client)
            if direct is None:
                # Only a plain pool: a blocking pool's cap on connections, a sentinel's choice of
                # node, are the pool's own, and a connection of our own would bypass them.
                plain = type(getattr(client, "connection_pool", None)) is redis.ConnectionPool
                direct = _by_client[client] = DirectCommands(client) if plain else ViaClient(client)
    return direct


try:
    from hiredis import pack_command as _pack_command
except ImportError:  # redis-py's own packing, in Python
    _pack_command = None


class AsyncDirectCommands:
    """`DirectCommands` for one event loop: a command from a coroutine, past redis-py's
    per-command machinery, with no thread to hand it to and back.

    Connections are made with an asyncio client's own settings (`pool`: its connection pool,
    whose class and arguments are used; the pool itself hands out none of these) and belong to
    the loop they were made on. The same rules as `DirectCommands`: an error reply leaves the
    connection in use; any other failure, a cancellation included, closes it, so a half-read
    reply is never read by the next caller; a reused connection the server dropped is tried once
    more on a fresh one; a timeout is never retried.
    """

    def __init__(self, pool: Any) -> None:  # pool: redis.asyncio.ConnectionPool
        options = dict(pool.connection_kwargs)
        # The pool's socket timeout bounds each whole round trip here, in one asyncio.timeout:
        # redis-py's own applies it to the send with asyncio.wait_for, a task per command.
        self._timeout: float | None = options.pop("socket_timeout", None)
        self._connect = functools.partial(pool.connection_class, **options, socket_timeout=None)
        self._idle: collections.deque = collections.deque()

    async def execute(self, *args: Any) -> Any:
        return await self._on_a_connection(self._round_trip, args)

    async def execute_many(self, *commands: Command) -> list[Any]:
        """Several commands in one round trip (a pipeline, not a transaction): their replies in
        order. An error reply raises, once every reply is read (the connection stays in step)."""
        replies = await self.replies(*commands)
        raise_first_error(replies)
        return replies

    async def replies(self, *commands: Command) -> list[Any]:
        """`execute_many`, an error reply given in its place (a `redis.ResponseError`) rather
        than raised: for a caller that tells apart which of its commands failed."""
        return await self._on_a_connection(self._round_trip_many, commands)

    async def _on_a_connection(self, exchange: Callable[[Any, Any], Awaitable[Any]], payload: Any) -> Any:
        """`exchange(connection, payload)` on an idle connection or a new one; once more on a
        fresh one if a reused connection turns out dropped."""
        try:
            connection, reused = self._idle.pop(), True
        except IndexError:
            connection, reused = self._connect(), False
        try:
            return await exchange(connection, payload)
        except redis.ConnectionError:
            if not reused:
                raise
            return await exchange(self._connect(), payload)

    async def _round_trip(self, connection: Any, args: tuple[Any, ...]) -> Any:
        try:
            async with asyncio.timeout(self._timeout):
                if _pack_command is not None:  # hiredis packs in C what redis-py packs in Python
                    await connection.send_packed_command(_pack_command(args))
                else:
                    await connection.send_command(*args)
                reply = await connection.read_response()
        except redis.ResponseError:
            self._idle.append(connection)
            raise
        except TimeoutError as exc:  # asyncio's: the round trip outlived the socket timeout
            await connection.disconnect(nowait=True)
            raise self._timed_out() from exc
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        self._idle.append(connection)
        return reply

    async def _round_trip_many(self, connection: Any, commands: tuple[Command, ...]) -> list[Any]:
        replies: list[Any] = []
        try:
            async with asyncio.timeout(self._timeout):
                if _pack_command is not None:
                    await connection.send_packed_command(b"".join(_pack_command(c) for c in commands))
                else:
                    await connection.send_packed_command(connection.pack_commands(commands))
                for _ in commands:
                    try:
                        replies.append(await connection.read_response())
                    except redis.ResponseError as exc:  # read whole: the next reply follows
                        replies.append(exc)
        except TimeoutError as exc:
            await connection.disconnect(nowait=True)
            raise self._timed_out() from exc
        except BaseException:  # a half-read reply is never read by the next caller
            await connection.disconnect(nowait=True)
            raise
        self._idle.append(connection)
        return replies

    def _timed_out(self) -> redis.TimeoutError:
        return redis.TimeoutError(f"Timeout after {self._timeout} s on a command to Redis")

    async def close(self) -> None:
        while self._idle:
            await self._idle.pop().disconnect(nowait=True)
