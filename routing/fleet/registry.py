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
from dataclasses import dataclass, field

import redis

from routing.contract.tasks import CONTRACT_VERSION
from routing.state.lua import lua_text
from routing.state.pacing import pause_point
from routing.state.redis_keys import reply_text

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
    contract_version: int = CONTRACT_VERSION  # the task contract it speaks (routing.contract.tasks)
    instance: str = ""  # this process's instance id: a restart under the same name is a new one
    role: str = "both"  # routing.contract.tasks.ROLES: `encode` workers take no generate tasks
    # The engine's state when the beat was sent (workers.engine.EngineLoad; 0 for encode workers).
    running: int = 0  # requests in the engine's batch
    waiting: int = 0  # requests accepted, not yet in the batch
    max_running: int = 0  # ENGINE_MAX_RUNNING: the batch's cap
    kv_blocks_used: int = 0  # KV pool blocks held by running requests
    kv_blocks_free: int = 0  # blocks a new request could get (free, or cached and evictable)
    running_peak: int = 0  # the most requests ever in one batch (since the process started)
    forward_passes: int = 0  # model steps since start
    generated_tokens: int = 0  # tokens generated since start
    prefill_tokens_per_s: float = 0.0  # the engine's measured prefill rate (0: not measured yet)
    # Its engine's ENGINE_SCHEDULE_POLICY ("shortest_first" or "fcfs"); "" from a worker that
    # does not say (an older one, an encode worker): the router assumes the frontend's own.
    schedule_policy: str = ""
    beat_at: float = 0.0  # when this beat was sent (a successor watches it move)
    # Its model's config.json model_type, and the fingerprint of its routing files
    # (routing.prompt.model_card); "" from a worker from before models were rows.
    family: str = ""
    fingerprint: str = ""

    def to_json(self) -> str:
        # Its fields, in order: each a number, a string or a bool, which `asdict` would deep-copy
        # one by one (44 us against 7.5 us a beat; a process of a thousand simulated workers
        # sends a thousand beats a round).
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        data = json.loads(raw)
        if data.keys() == _FIELD_NAMES:
            # A beat of this version, every field and nothing more (`to_json`): its values are
            # the fields as they are, so they go in as they are. Through `__init__` a frozen
            # dataclass sets its 30 fields one `object.__setattr__` at a time, which took 40% of
            # the parse: a frontend parses every changed beat of its fleet at each read (a
            # thousand workers' every half second under load).
            beat = object.__new__(cls)
            beat.__dict__.update(data)
            return beat
        data.setdefault("contract_version", 1)  # a worker from before the contract had a version
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


_FIELD_NAMES = frozenset(Heartbeat.__dataclass_fields__)


def new_instance_id() -> str:
    """A fresh id for one worker process; the heartbeat and every task event carry it."""
    return uuid.uuid4().hex[:16]


def heartbeat_key(namespace: str, name: str) -> str:
    return f"{namespace}{HEARTBEAT_FAMILY}{name}"


class NameInUse(RuntimeError):
    """Another live process (it still renews its heartbeat) already serves under this name."""

    def __init__(self, holder: Heartbeat) -> None:
        self.holder = holder
        super().__init__(
            f"worker {holder.name!r} is already running: instance {holder.instance or '?'}, "
            f"pid {holder.pid} on {holder.host or '?'} still renews its heartbeat; stop it first "
            "or choose another --name"
        )


# Deletes the heartbeat only if it is the given instance's (routing/fleet/lua/).
_REMOVE_OWN_LUA = lua_text(__package__, "remove_own_heartbeat.lua")


# The most heartbeat keys one MGET reads (WorkerRegistry._read).
READ_CHUNK = 128


class WorkerRegistry:
    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._client = client
        self._namespace = namespace
        # name -> (the heartbeat's bytes as last read, their parse): see _beats.
        self._parsed: dict[str, tuple[bytes | str, Heartbeat]] = {}

    def _key(self, name: str) -> str:
        return heartbeat_key(self._namespace, name)

    def beat(self, heartbeat: Heartbeat, ttl_s: float) -> None:
        self._client.set(self._key(heartbeat.name), heartbeat.to_json(), px=int(ttl_s * 1000))

    def beat_many(self, heartbeats: Iterable[Heartbeat], ttl_s: float) -> None:
        """Many workers' beats in one round trip (a process of simulated workers)."""
        pipe = self._client.pipeline(transaction=False)
        for heartbeat in heartbeats:
            pipe.set(self._key(heartbeat.name), heartbeat.to_json(), px=int(ttl_s * 1000))
        pipe.execute()

    def remove(self, name: str, instance: str = "") -> bool:
        """Deregister; with an instance, only if the heartbeat is still that instance's."""
        return bool(self._client.eval(_REMOVE_OWN_LUA, 1, self._key(name), instance))

    def get(self, name: str) -> Heartbeat | None:
        raw = self._client.get(self._key(name))
        return None if raw is None else Heartbeat.from_json(raw)

    def claim(self, name: str, instance: str, watch_s: float) -> Heartbeat | None:
        """The same-name start rule, for a new process `instance` starting as worker `name`.

        No live heartbeat: None. A heartbeat of another instance: watch it for `watch_s` (one
        heartbeat interval and a little): if it is renewed, that process is alive and
        `NameInUse` names it; if not, it is dead and its heartbeat is returned, for the caller to
        take over at once (free its load, fail over its requests) instead of waiting for the TTL.
        """
        first = self.get(name)
        if first is None or first.instance == instance:
            return None
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))
            now = self.get(name)
            if now is None:
                return first  # it lapsed while we watched: dead
            if now.instance != first.instance or now.beat_at != first.beat_at:
                raise NameInUse(now)
        return first

    def alive(self, names: Iterable[str]) -> dict[str, Heartbeat]:
        names = list(names)
        if not names:
            return {}
        return self._beats(names, self._read([self._key(n) for n in names]))

    def alive_and_get(self, names: Iterable[str], key: str) -> tuple[bytes | None, dict[str, Heartbeat]]:
        """`alive(names)`, and the value of one more key of the namespace, read first."""
        names = list(names)
        first, *raw = self._read([f"{self._namespace}{key}", *(self._key(n) for n in names)])
        return first, self._beats(names, raw)

    def _read(self, keys: list[str]) -> list:
        """MGETs of at most READ_CHUNK keys, one after the other: a fleet's heartbeats in one
        MGET are a reply of hundreds of kilobytes that holds Redis (single-threaded) for
        milliseconds, every other client's command waiting behind it."""
        if len(keys) <= READ_CHUNK:
            return self._client.mget(keys)
        out: list = []
        for at in range(0, len(keys), READ_CHUNK):
            out += self._client.mget(keys[at : at + READ_CHUNK])
        return out

    def _beats(self, names: list[str], raw: list) -> dict[str, Heartbeat]:
        """The heartbeats of `names`' values, by name (a missing one: not live). A value read
        before is not parsed again: between two beats a frontend reads the same bytes several
        times, and parsing a thousand of them holds the interpreter for milliseconds."""
        parsed, out = self._parsed, {}
        if len(parsed) > 2 * len(names) + 1024:  # names no read asks about any more
            self._parsed = parsed = {name: parsed[name] for name in names if name in parsed}
        for name, value in zip(names, raw, strict=True):
            if value is None:
                parsed.pop(name, None)
                continue
            known = parsed.get(name)
            if known is None or known[0] != value:
                known = parsed[name] = (value, Heartbeat.from_json(value))
                pause_point()  # (a fleet read in the background: routing.state.pacing)
            out[name] = known[1]
        return out

    def all_alive(self) -> dict[str, Heartbeat]:
        prefix = self._key("")
        keys = [reply_text(k) for k in self._client.scan_iter(match=f"{prefix}*")]
        return self.alive([k[len(prefix) :] for k in keys])

    def next_round_robin(self) -> int:
        return int(self._client.incr(f"{self._namespace}{ROUND_ROBIN_KEY}"))
