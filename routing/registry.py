"""Live worker registry: each worker process keeps a heartbeat key in Redis with a TTL.

A worker is live while its heartbeat exists. The database row (routing.models.Worker) is the
operator's handle (enable, drain); liveness itself never touches the database, so a worker
killed with SIGKILL drops out of the live set when its TTL lapses, whatever the database says.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import redis

from routing.contract import CONTRACT_VERSION

HEARTBEAT_FAMILY = "hb:"
ROUND_ROBIN_KEY = "rr"


@dataclass(frozen=True)
class Heartbeat:
    name: str
    model: str
    block_size: int
    device: str = "cpu"
    pid: int = 0
    host: str = ""
    started_at: float = field(default_factory=time.time)
    publishes_events: bool = True
    kv_capacity_blocks: int = 0
    stopping: bool = False  # SIGTERM received: finishing current work, taking nothing new
    session_scoped: bool = False  # DYN_MM_IMAGE_CACHE_SESSION_SCOPED on this worker
    shared_image_cache: str = "off"  # its shared image cache URL, password redacted, or "off"
    contract_version: int = CONTRACT_VERSION  # the task contract it speaks (routing.contract)
    instance: str = ""  # this process's instance id: a restart under the same name is a new one
    role: str = "both"  # routing.contract.ROLES: `encode` workers take no generate tasks
    # The engine's state when the beat was sent (workers.engine.EngineLoad; 0 for encode workers).
    running: int = 0  # requests in the engine's batch
    waiting: int = 0  # requests accepted, not yet in the batch
    max_running: int = 0  # ENGINE_MAX_RUNNING: the batch's cap
    kv_blocks_used: int = 0  # KV pool blocks held by running requests
    kv_blocks_free: int = 0  # blocks a new request could get (free, or cached and evictable)
    running_peak: int = 0  # the most requests ever in one batch (since the process started)
    forward_passes: int = 0  # model steps since start
    generated_tokens: int = 0  # tokens generated since start

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        data = json.loads(raw)
        data.setdefault("contract_version", 1)  # a worker from before the contract had a version
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def new_instance_id() -> str:
    """A fresh id for one worker process; the heartbeat and every task event carry it."""
    return uuid.uuid4().hex[:16]


def heartbeat_key(namespace: str, name: str) -> str:
    return f"{namespace}{HEARTBEAT_FAMILY}{name}"


class WorkerRegistry:
    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._client = client
        self._namespace = namespace

    def _key(self, name: str) -> str:
        return heartbeat_key(self._namespace, name)

    def beat(self, heartbeat: Heartbeat, ttl_s: float) -> None:
        self._client.set(self._key(heartbeat.name), heartbeat.to_json(), px=int(ttl_s * 1000))

    def remove(self, name: str) -> None:
        self._client.delete(self._key(name))

    def alive(self, names: Iterable[str]) -> dict[str, Heartbeat]:
        names = list(names)
        if not names:
            return {}
        raw = self._client.mget([self._key(n) for n in names])
        return {n: Heartbeat.from_json(r) for n, r in zip(names, raw, strict=True) if r is not None}

    def all_alive(self) -> dict[str, Heartbeat]:
        prefix = self._key("")
        keys = [k.decode() if isinstance(k, bytes) else k for k in self._client.scan_iter(match=f"{prefix}*")]
        return self.alive([k[len(prefix) :] for k in keys])

    def next_round_robin(self) -> int:
        return int(self._client.incr(f"{self._namespace}{ROUND_ROBIN_KEY}"))
