"""The router's direct line to Redis (routing.state.redis_direct): what redis-py's client promised for
the router's scripts still holds without its per-command machinery."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis

from routing.state.lua import LuaScript
from routing.state.redis_direct import DirectCommands, direct_commands
from tests.platform_harness import PrivateRedis


def test_replies_errors_and_connections_are_those_of_the_client(redis_client, key_namespace) -> None:
    direct = DirectCommands(redis_client)
    key = f"{key_namespace}n"
    assert direct.execute("INCRBY", key, 5) == 5
    assert direct.execute("GET", key) == b"5"
    # An error reply is raised as the client raises it, and the connection stays in step: the
    # next command on it reads its own reply, not a leftover.
    with pytest.raises(redis.ResponseError, match="not an integer"):
        direct.execute("INCRBY", key, "x")
    assert direct.execute("GET", key) == b"5"
    assert len(direct._idle) == 1  # one caller at a time: one connection, reused throughout
    direct.close()


def test_concurrent_callers_each_get_their_own_connection(redis_client, key_namespace) -> None:
    direct = DirectCommands(redis_client)
    key = f"{key_namespace}counter"
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for i in range(300):
                # Each reply must be the caller's own: a shared connection would hand replies across.
                assert (
                    direct.execute("ECHO", f"{threading.get_ident()}-{i}")
                    == f"{threading.get_ident()}-{i}".encode()
                )
                direct.execute("INCR", key)
        except BaseException as exc:  # reported below, on the test thread
            errors.append(exc)

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert redis_client.get(key) == b"1800"
    assert 1 <= len(direct._idle) <= 6
    direct.close()


def test_a_script_call_survives_a_redis_restart_that_flushed_the_scripts(tmp_path) -> None:
    """Redis restarted empty: the idle connection is dead and the script unknown. One call still
    answers: a fresh connection, then the script loaded again."""
    server = PrivateRedis(tmp_path)
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        script = LuaScript(client, "return redis.call('INCRBY', ARGV[1], ARGV[2])")
        assert script("k", 2) == 2
        server.kill()
        server.start()
        assert script("k", 3) == 3  # the data went with the restart; the call did not fail
        assert client.get("k") == b"3"
        client.close()
    finally:
        server.stop()


def test_redis_down_fails_at_once_and_a_timeout_is_not_retried(tmp_path) -> None:
    server = PrivateRedis(tmp_path)
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        direct = DirectCommands(client)
        assert direct.execute("INCR", "k") == 1
        # Frozen: the reply never comes. One timeout, no second attempt, and the connection that
        # timed out is dropped (a late reply must not reach the next caller).
        server.process.send_signal(signal.SIGSTOP)
        with pytest.raises(redis.TimeoutError):
            direct.execute("INCR", "k")
        assert len(direct._idle) == 0
        server.process.send_signal(signal.SIGCONT)
        # The INCR that timed out runs once Redis wakes (it was in the socket), and never twice.
        deadline = time.monotonic() + 5
        while direct.execute("GET", "k") != b"2" and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert direct.execute("GET", "k") == b"2"
        server.kill()
        with pytest.raises(redis.ConnectionError):
            direct.execute("GET", "k")
        client.close()
    finally:
        server.stop()


def test_a_forked_child_never_uses_the_parents_connections(redis_client, key_namespace) -> None:
    direct = direct_commands(redis_client)
    assert direct_commands(redis_client) is direct  # one line per client, shared by its scripts
    key = f"{key_namespace}fork"
    direct.execute("SET", key, "parent")
    parent_connection = direct._idle[0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a connection of its own, the parent's left untouched
        try:
            ok = direct.execute("GET", key) == b"parent" and parent_connection not in direct._idle
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    # The parent's connection still works: the child neither wrote to it nor shut it down.
    assert direct.execute("GET", key) == b"parent"
    assert direct._idle[0] is parent_connection


def test_a_client_without_a_plain_pool_keeps_its_own_command_path(redis_url) -> None:
    """A sentinel's or cluster's pool picks its node per connection: the direct line would bypass
    that choice, so such a client's scripts go through the client (a pool subclass stands in for
    theirs)."""

    class NodePickingPool(redis.ConnectionPool):
        pass

    client = redis.Redis(connection_pool=NodePickingPool.from_url(redis_url))
    direct = direct_commands(client)
    assert not isinstance(direct, DirectCommands)
    assert direct.execute("PING") is True  # the client's reply callbacks still apply
    client.close()
