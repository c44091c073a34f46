"""The platform's asyncio Redis client (routing.state.redis_keys.async_client): a task that runs
its commands can always be cancelled, and its timeouts and URL scheme are kept."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest
import redis

from routing.state import redis_keys
from routing.state.redis_keys import async_client
from tests.platform_harness import PrivateRedis


async def test_a_task_running_commands_is_cancelled_wherever_the_cancellation_lands(
    redis_url, key_namespace
) -> None:
    # given a task that runs commands in a loop, as the frontend follows a request's answer
    client = async_client(redis_url)
    assert client.connection_pool.connection_kwargs["socket_timeout"]  # the case that lost them
    rng = random.Random(7)
    lost = 0

    async def follow(cancelled: asyncio.Event) -> str:
        while True:
            await client.get(f"{key_namespace}nothing")
            if cancelled.is_set():
                return "went on after its cancellation"

    for _ in range(200):
        cancelled = asyncio.Event()
        task = asyncio.create_task(follow(cancelled))
        await asyncio.sleep(rng.random() * 0.004)

        # when it is cancelled at a random point (the client went away)
        task.cancel()
        cancelled.set()

        # then it ends cancelled, every time (redis-py's wait_for lost 2 in 3 of these on 3.11)
        try:
            await task
            lost += 1
        except asyncio.CancelledError:
            pass
    assert lost == 0, f"{lost} of 200 cancellations lost"
    # and the connections are still good for the next command
    assert (
        await client.set(f"{key_namespace}after", b"1") and await client.get(f"{key_namespace}after") == b"1"
    )
    await client.delete(f"{key_namespace}after")


def test_the_urls_connection_class_is_kept_for_tls_and_unix_sockets() -> None:
    import redis.asyncio

    for url, base in (
        ("redis://127.0.0.1:6379/0", redis.asyncio.Connection),
        ("rediss://127.0.0.1:6380/0", redis.asyncio.SSLConnection),
        ("unix:///tmp/redis.sock?db=0", redis.asyncio.UnixDomainSocketConnection),
    ):
        pool = redis.asyncio.ConnectionPool.from_url(url)
        kept = redis_keys._keeping_cancellations(pool.connection_class)
        assert issubclass(kept, base) and kept.__name__ == base.__name__
        assert redis_keys._keeping_cancellations(pool.connection_class) is kept  # made once


async def test_a_frozen_redis_still_fails_a_command_within_the_socket_timeout(tmp_path) -> None:
    # given the client of a Redis that stops answering, with a 1 s socket timeout
    server = PrivateRedis(tmp_path)
    saved = redis_keys.SOCKET_TIMEOUT_S
    redis_keys.configure_timeouts(1.0)
    try:
        client = async_client(server.url)
        assert await client.ping()
        server.process.send_signal(signal.SIGSTOP)

        # when a command is sent, then it fails with Redis's timeout, not a hang
        with pytest.raises(redis.TimeoutError):
            await client.get("anything")
    finally:
        redis_keys.configure_timeouts(saved)
        server.stop()  # thaws it first
