"""The router's direct line to Redis from an event loop (routing.state.redis_direct's
AsyncDirectCommands): the same promises as the threaded line, on the loop's own connections."""

from __future__ import annotations

import asyncio
import signal

import pytest
import redis
import redis.asyncio

from routing.state.lua import LuaScript
from routing.state.redis_direct import AsyncDirectCommands
from tests.platform_harness import PrivateRedis


def _lines(url: str, **options: object) -> AsyncDirectCommands:
    return AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(url, **options))


async def test_replies_and_error_replies_leave_the_connection_in_step(
    redis_url, redis_client, key_namespace
) -> None:
    lines = _lines(redis_url)
    key = f"{key_namespace}n"
    assert await lines.execute("INCRBY", key, 5) == 5
    with pytest.raises(redis.ResponseError, match="not an integer"):
        await lines.execute("INCRBY", key, "x")
    # the next command on the same connection reads its own reply, not a leftover
    assert await lines.execute("GET", key) == b"5"
    assert len(lines._idle) == 1
    await lines.close()


async def test_concurrent_coroutines_each_get_their_own_connection(
    redis_url, redis_client, key_namespace
) -> None:
    lines = _lines(redis_url)
    key = f"{key_namespace}counter"

    async def hammer(who: int) -> None:
        for i in range(100):
            assert await lines.execute("ECHO", f"{who}-{i}") == f"{who}-{i}".encode()
            await lines.execute("INCR", key)

    await asyncio.gather(*(hammer(who) for who in range(6)))
    assert redis_client.get(key) == b"600"
    assert 1 <= len(lines._idle) <= 6
    await lines.close()


async def test_a_cancelled_call_closes_its_connection_instead_of_handing_it_on(
    redis_url, redis_client, key_namespace
) -> None:
    lines = _lines(redis_url)
    await lines.execute("PING")
    assert len(lines._idle) == 1
    waiting = asyncio.create_task(lines.execute("BLPOP", f"{key_namespace}never", 5))
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # Its reply (BLPOP's, whenever it comes) must never reach another caller: the connection went.
    assert len(lines._idle) == 0
    redis_client.rpush(f"{key_namespace}never", "late")
    assert await lines.execute("ECHO", "mine") == b"mine"
    await lines.close()


async def test_a_script_call_survives_a_redis_restart_that_flushed_the_scripts(tmp_path) -> None:
    server = PrivateRedis(tmp_path)
    try:
        lines = _lines(server.url, socket_timeout=5)
        client = redis.Redis.from_url(server.url)
        script = LuaScript(client, "return redis.call('INCRBY', ARGV[1], ARGV[2])")
        assert await script.acall(lines, "k", 2) == 2
        server.kill()
        server.start()
        assert await script.acall(lines, "k", 3) == 3  # a fresh connection, the script loaded again
        client.close()
        await lines.close()
    finally:
        server.stop()


async def test_with_redis_frozen_a_call_meets_one_timeout_and_its_connection_goes(tmp_path) -> None:
    server = PrivateRedis(tmp_path)
    try:
        lines = _lines(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        assert await lines.execute("INCR", "k") == 1
        server.process.send_signal(signal.SIGSTOP)
        with pytest.raises(redis.TimeoutError):
            await lines.execute("INCR", "k")
        assert len(lines._idle) == 0
        server.process.send_signal(signal.SIGCONT)
        server.kill()
        with pytest.raises(redis.ConnectionError):
            await lines.execute("GET", "k")
        await lines.close()
    finally:
        server.stop()


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_response_stream_reads_back_on_the_loops_own_line_as_the_worker_wrote_it(
    redis_url, redis_client, key_namespace, protocol
) -> None:
    from routing.contract.responses import ResponseWriter, read_response_events

    # given a worker's answer on its response stream: two tokens, then the end
    writer = ResponseWriter(redis_client, key_namespace, "r-1")
    writer.send("token", text="Hel", token_ids=[1])
    writer.send("token", text="lo", token_ids=[2])
    writer.send("done", finish_reason="stop")
    lines = _lines(redis_url, protocol=protocol)

    # when the frontend reads it, all at once and then after the first event
    events = await read_response_events(lines, key_namespace, "r-1", "0-0", 100)
    later = await read_response_events(lines, key_namespace, "r-1", events[0].id, 100)

    # then each event comes back as written, in order, and nothing more; an empty wait is no event
    assert [(e.type, e.data) for e in events] == [
        ("token", {"text": "Hel", "token_ids": [1]}),
        ("token", {"text": "lo", "token_ids": [2]}),
        ("done", {"finish_reason": "stop"}),
    ]
    assert later == events[1:]
    assert await read_response_events(lines, key_namespace, "r-1", events[-1].id, 50) == []
    assert await read_response_events(lines, key_namespace, "r-none", "0-0", 50) == []
    await lines.close()


async def test_several_commands_go_in_one_round_trip_and_an_error_reply_leaves_the_line_in_step(
    redis_url, redis_client, key_namespace
) -> None:
    lines = _lines(redis_url)
    key = f"{key_namespace}h"
    # replies in order
    assert await lines.execute_many(
        ("HINCRBY", key, "a", 2), ("HINCRBY", key, "b", 3), ("HGET", key, "a")
    ) == [
        2,
        3,
        b"2",
    ]
    # an error reply in the middle: raised once every reply is read, the others' effects made
    with pytest.raises(redis.ResponseError, match="not an integer"):
        await lines.execute_many(
            ("HINCRBY", key, "a", 1), ("HINCRBY", key, "a", "x"), ("HINCRBY", key, "b", 1)
        )
    assert redis_client.hgetall(key) == {b"a": b"3", b"b": b"4"}
    # and the connection reads its own replies after it
    assert await lines.execute("HGET", key, "b") == b"4"
    assert len(lines._idle) == 1
    await lines.close()


async def test_replies_give_an_error_reply_in_its_place_and_raise_nothing(
    redis_url, redis_client, key_namespace
) -> None:
    lines = _lines(redis_url)
    key = f"{key_namespace}h"
    replies = await lines.replies(("HINCRBY", key, "a", 1), ("HINCRBY", key, "a", "x"), ("HGET", key, "a"))
    assert replies[0] == 1 and replies[2] == b"1"
    assert isinstance(replies[1], redis.ResponseError) and "not an integer" in str(replies[1])
    await lines.close()


class _ForgetfulRedisFaultInjected:
    """A loop's connections to a Redis that forgot its scripts (restarted): the first EVALSHA of
    a round trip is refused with NOSCRIPT once, the round trip's other commands run."""

    def __init__(self, lines: AsyncDirectCommands) -> None:
        self.lines, self.refused = lines, 0

    async def execute(self, *command):
        return await self.lines.execute(*command)

    async def replies(self, *commands):
        if commands[0][0] == "EVALSHA" and not self.refused:
            self.refused += 1
            return [
                redis.exceptions.NoScriptError("NOSCRIPT No matching script."),
                *await self.lines.replies(*commands[1:]),
            ]
        return await self.lines.replies(*commands)


@pytest.mark.parametrize("forgotten", [False, True])
async def test_a_script_sends_the_callers_commands_in_its_round_trip_and_runs_once_if_redis_forgot_it(
    redis_url, redis_client, key_namespace, forgotten
) -> None:
    # given a script that counts its runs, and lines to a Redis that may have forgotten it
    script = LuaScript(redis_client, "return redis.call('INCR', ARGV[1])")
    lines = _lines(redis_url)
    on = _ForgetfulRedisFaultInjected(lines) if forgotten else lines
    runs, along = f"{key_namespace}runs", f"{key_namespace}along"

    # when it runs with two commands of the caller's along
    reply = await script.acall(on, runs, along=[("HINCRBY", along, "a", 1), ("HINCRBY", along, "b", 2)])

    # then the script ran once (again after a NOSCRIPT), the commands once each
    assert reply == 1 and redis_client.get(runs) == b"1"
    assert redis_client.hgetall(along) == {b"a": b"1", b"b": b"2"}
    # and a command of the caller's that fails raises, after the script ran
    with pytest.raises(redis.ResponseError, match="not an integer"):
        await script.acall(lines, runs, along=[("HINCRBY", along, "a", "x")])
    assert redis_client.get(runs) == b"2"
    await lines.close()
