"""A real three-node Redis Cluster on free local ports, for tests of cluster-aware clients.

`RedisClusterNodes` starts `redis-server --cluster-enabled yes` nodes in a temporary
directory, joins them with `redis-cli --cluster create`, waits for `cluster_state:ok` and
tears everything down; `kill(index)` stops one node mid-test.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

CLUSTER_BUS_OFFSET = 10000


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_node_port(taken: set[int]) -> int:
    # A node needs its port and port + 10000 (the cluster bus) free.
    for _ in range(500):
        port = random.randint(20000, 50000)
        if port in taken or port + CLUSTER_BUS_OFFSET in taken:
            continue
        if _port_is_free(port) and _port_is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterNodes:
    """Three primaries, no replicas, `cluster-require-full-coverage no`."""

    def __init__(self, size: int = 3, node_timeout_ms: int = 5000) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server and redis-cli are needed for cluster tests")
        self.size = size
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self._dir = Path(tempfile.mkdtemp(prefix="redis-cluster-"))

    @property
    def url(self) -> str:
        """The URL of the first node, the one clients discover the cluster through."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start(self) -> None:
        taken: set[int] = set()
        for _ in range(self.size):
            port = _free_node_port(taken)
            taken.update({port, port + CLUSTER_BUS_OFFSET})
            self.ports.append(port)
            self.processes.append(self._start_node(port))
        for port in self.ports:
            self._wait_until(lambda p=port: redis.Redis(port=p, socket_timeout=0.5).ping(), "node up")
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        for port in self.ports:
            self._wait_until(lambda p=port: self._state(p) == "ok", "cluster_state:ok")

    def _start_node(self, port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                "redis-server",
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(self._dir),
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-require-full-coverage", "no",
                "--save", "",
                "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    @staticmethod
    def _state(port: int) -> str:
        # redis-py parses CLUSTER INFO into a dict.
        info = redis.Redis(port=port, socket_timeout=0.5, decode_responses=True).cluster("info")
        return str(info.get("cluster_state", ""))

    @staticmethod
    def _wait_until(condition: object, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError, OSError):
                if condition():  # type: ignore[operator]
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster: timed out waiting for {what}")
            time.sleep(0.05)

    def node_for_key(self, key: str) -> int:
        """Index of the node serving the slot of `key`."""
        client = redis.Redis(port=self.ports[0], socket_timeout=1)
        slot = client.execute_command("CLUSTER KEYSLOT", key)
        for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return self.ports.index(int(primary[1]))
        raise LookupError(f"no node serves slot {slot}")

    def kill(self, index: int) -> None:
        process = self.processes[index]
        process.kill()
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def running_redis_cluster(size: int = 3) -> Iterator[RedisClusterNodes]:
    cluster = RedisClusterNodes(size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """One cluster for a whole test module (starting one takes a second or two)."""
    with running_redis_cluster() as cluster:
        yield cluster
