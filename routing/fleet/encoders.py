"""Encode workers (E/PD) in Redis: what each one's embedding cache holds, how many images wait
on it, the choice of one for a request's images, the per-request "encoded" signal the LLM worker
waits on, and the counters the dashboard and /metrics show.

Keys (this module owns them):
- `<ns>enc:cached:<worker>`: set of cache tags (`<scope or ->:<identity>`) in its embedding cache;
- `<ns>enc:pending:<worker>`: sorted set of images sent to it (`<request>:<index>`), scored by
  the time they stop counting (a frontend or encoder that died leaves nothing behind for long);
- `<ns>enc:busy:<worker>`: images it has taken and not finished (loading, waiting for its tower,
  encoding);
- `<ns>enc:done:<request>`: list of per-image results the LLM worker waits on (short TTL);
- `<ns>enc:stats:<worker>`: hash of counters (see STAT_FIELDS), under the deployment's statistics
  namespace (routing.deployment) when the pool is given one, so another deployment's never add up;
- `<ns>enc:local:<llm worker>`: sorted set of images the frontend left an LLM worker to encode
  itself (the split below), scored by when it is expected to have encoded them: its own encoding
  backlog, gone on its own once the time has passed.

The split (`split_images`, pure): the chosen encoder's backlog (images pending on it times its
measured milliseconds per image) is weighed against the LLM worker's own (the images it was
left to encode and has not finished, by the same estimate, times `local_weight`): each image
goes where it would be encoded sooner, an image the encoder's embedding cache holds always to
the encoder. At low load every image goes to the encoder; when the encoder's queue grows past
what the LLM worker would take to encode an image, some (or all) of the request's images stay
on the LLM worker's aggregated path, so encoding capacity is not halved by the disaggregation
(llm-d's encoder-affinity choice lost at high load because it ignored encoder load).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import redis

from routing.state.redis_keys import reply_text

CACHED_FAMILY = "enc:cached:"
PENDING_FAMILY = "enc:pending:"
BUSY_FAMILY = "enc:busy:"
DONE_FAMILY = "enc:done:"
STATS_FAMILY = "enc:stats:"
LOCAL_FAMILY = "enc:local:"
DONE_TTL_SECS = 300

# Encode worker: images encoded, its embedding cache's hits and misses, microseconds encoding,
# bytes and microseconds writing to the store. LLM worker: features received (bytes, microseconds
# reading and checking them), and fallbacks to its own encoder by cause. Every worker: forward
# passes of its vision tower (a forward hook), whatever the role.
STAT_FIELDS: tuple[str, ...] = (
    "images",
    "cache_hits",
    "cache_misses",
    "encode_us",
    "put_bytes",
    "put_us",
    "received",
    "received_bytes",
    "get_us",
    "fallback_missing",
    "fallback_corrupt",
    "fallback_encoder_gone",
    "fallback_timeout",
    "tower_forwards",
)
FALLBACK_CAUSES: tuple[str, ...] = ("missing", "corrupt", "encoder_gone", "timeout")


def cache_tag(partition: str | None, identity: str) -> str:
    """How an embedding cache entry is named in Redis: by cache partition and image (model and
    processor are one per deployment, as for the KV index)."""
    return f"{partition or '-'}:{identity}"


def cache_partition(session_scoped: bool, scope_key: str | None, cache_salt: str | None) -> str | None:
    """What partitions a request's embedding cache entries on a worker (workers.runtime's rule):
    with session scoping the scope, otherwise the caller's cache salt (None: the shared pool)."""
    if session_scoped:
        return scope_key
    return None if cache_salt is None else f"salt-{int(cache_salt, 16):016x}"


def cached_key(namespace: str, worker: str) -> str:
    return f"{namespace}{CACHED_FAMILY}{worker}"


def pending_key(namespace: str, worker: str) -> str:
    return f"{namespace}{PENDING_FAMILY}{worker}"


def busy_key(namespace: str, worker: str) -> str:
    return f"{namespace}{BUSY_FAMILY}{worker}"


def done_key(namespace: str, request_id: str) -> str:
    return f"{namespace}{DONE_FAMILY}{request_id}"


def stats_key(namespace: str, worker: str) -> str:
    return f"{namespace}{STATS_FAMILY}{worker}"


def local_key(namespace: str, worker: str) -> str:
    return f"{namespace}{LOCAL_FAMILY}{worker}"


@dataclass(frozen=True)
class EncoderScore:
    worker: str
    cached: int  # of the request's images, how many its embedding cache holds
    pending: int  # images sent to it and not finished yet (its queue and the one it is encoding)
    cost: float  # images it must encode before this request's are ready
    encode_ms: float | None = None  # its measured milliseconds per encoded image (None: none yet)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EncoderChoice:
    worker: str
    scores: list[EncoderScore]


def score_encoders(
    tags: Sequence[str], cached: Mapping[str, int], pending: Mapping[str, int]
) -> list[EncoderScore]:
    """Embedding-cache affinity weighed against load: a cached image costs nothing, every other
    image costs one encode, and so does every image already waiting on the worker (llm-d's
    affinity-only choice piled requests onto one encoder under load)."""
    return [
        EncoderScore(
            worker, cached[worker], pending[worker], float(len(tags) - cached[worker] + pending[worker])
        )
        for worker in sorted(cached)
    ]


@dataclass(frozen=True)
class EncodeSplit:
    """Which of a request's images (positions in the list given) the encoder encodes and which the
    LLM worker keeps, and when each side is expected to be done (ms from now)."""

    to_encoder: tuple[int, ...]
    kept_local: tuple[int, ...]
    encoder_ready_ms: float
    local_ready_ms: float
    encoder_backlog_ms: float
    local_backlog_ms: float
    encode_ms: float
    local_encode_ms: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: an infinite figure (the split turned off) reads as None."""
        return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in asdict(self).items()}


def split_images(
    cached: Sequence[bool],
    *,
    encoder_pending: int,
    encode_ms: float,
    local_backlog_ms: float,
    local_weight: float,
) -> EncodeSplit:
    """The split of a request's images between the chosen encode worker and the LLM worker.

    `cached[i]`: the encoder's embedding cache holds image i (it costs the encoder nothing);
    `encoder_pending`: images already waiting on the encoder, each `encode_ms` (measured);
    `local_backlog_ms`: what the LLM worker was already left to encode; one image costs it
    `encode_ms * local_weight` (the same tower; the weight > 1 says that its encoding stalls the
    LLM worker's batch, text requests included, where an encoder's stalls nothing else).
    Greedily, in order, each uncached image goes where it would be done sooner, ties to the
    encoder: list scheduling on two machines. With `local_weight` infinite nothing stays local."""
    if encode_ms < 0 or local_backlog_ms < 0 or encoder_pending < 0 or not local_weight > 0:
        raise ValueError("encode_ms, backlogs and pending must be >= 0 and local_weight > 0")
    local_ms = math.inf if math.isinf(local_weight) else encode_ms * local_weight
    encoder_backlog = encoder_pending * encode_ms
    encoder_ready, local_ready = encoder_backlog, local_backlog_ms
    to_encoder: list[int] = []
    kept: list[int] = []
    for position, held in enumerate(cached):
        if held:
            to_encoder.append(position)
        elif encoder_ready + encode_ms <= local_ready + local_ms:
            to_encoder.append(position)
            encoder_ready += encode_ms
        else:
            kept.append(position)
            local_ready += local_ms
    return EncodeSplit(
        tuple(to_encoder),
        tuple(kept),
        encoder_ready,
        local_ready,
        encoder_backlog,
        local_backlog_ms,
        encode_ms,
        local_ms,
    )


def select_encoder(scores: Sequence[EncoderScore], rng: random.Random | None = None) -> str:
    best = min(score.cost for score in scores)
    tied = [score.worker for score in scores if score.cost == best]
    return tied[0] if len(tied) == 1 else (rng or random).choice(tied)


class EncoderPool:
    """The frontend's and the workers' view of the encode workers' shared state."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        *,
        pending_ttl_s: float = 120.0,
        statistics_namespace: str | None = None,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._pending_ttl_s = pending_ttl_s
        # Counters (enc:stats) are statistics: kept apart per deployment; the rest is live state.
        self._statistics = namespace if statistics_namespace is None else statistics_namespace

    # --- frontend -------------------------------------------------------------------------------
    def scores(self, workers: Iterable[str], tags: Sequence[str]) -> list[EncoderScore]:
        workers = sorted(workers)
        if not workers:
            return []
        now = time.time()
        pipe = self._client.pipeline(transaction=False)
        for worker in workers:
            if tags:
                pipe.smismember(cached_key(self._namespace, worker), list(tags))
            pipe.zcount(pending_key(self._namespace, worker), now, "+inf")
            pipe.hmget(stats_key(self._statistics, worker), ["encode_us", "cache_misses"])
        answers = iter(pipe.execute())
        cached: dict[str, int] = {}
        pending: dict[str, int] = {}
        encode_ms: dict[str, float | None] = {}
        for worker in workers:
            cached[worker] = sum(1 for held in next(answers) if held) if tags else 0
            pending[worker] = int(next(answers))
            encode_us, misses = (int(v or 0) for v in next(answers))
            encode_ms[worker] = encode_us / 1000 / misses if misses else None
        return [
            dataclasses.replace(score, encode_ms=encode_ms[score.worker])
            for score in score_encoders(tags, cached, pending)
        ]

    def held(self, worker: str, tags: Sequence[str]) -> list[bool]:
        """Which of these tags the worker's embedding cache holds (per tag, in order)."""
        if not tags:
            return []
        return [bool(h) for h in self._client.smismember(cached_key(self._namespace, worker), list(tags))]

    def local_backlog_ms(self, worker: str) -> float:
        """How long the LLM worker is expected to take for the images it was left to encode."""
        now = time.time()
        last = self._client.zrevrangebyscore(local_key(self._namespace, worker), "+inf", now, 0, 1, True)
        return max(0.0, (float(last[0][1]) - now) * 1000) if last else 0.0

    def keep_local(self, worker: str, members: Sequence[str], ready_ms: Sequence[float]) -> None:
        """Images left to the LLM worker, each counted until its expected end (`ready_ms` from now)."""
        if not members:
            return
        key = local_key(self._namespace, worker)
        now = time.time()
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(key, {m: now + ms / 1000 for m, ms in zip(members, ready_ms, strict=True)})
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.expire(key, int(self._pending_ttl_s) + 60)
        pipe.execute()

    def choose(self, workers: Iterable[str], tags: Sequence[str]) -> EncoderChoice | None:
        scores = self.scores(workers, tags)
        if not scores:
            return None
        return EncoderChoice(select_encoder(scores), scores)

    def reserve(self, worker: str, members: Sequence[str]) -> None:
        """Counts images sent to an encoder until it finishes them (or they expire)."""
        if not members:
            return
        key = pending_key(self._namespace, worker)
        expiry = time.time() + self._pending_ttl_s
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(key, dict.fromkeys(members, expiry))
        pipe.zremrangebyscore(key, "-inf", time.time())
        pipe.expire(key, int(self._pending_ttl_s) + 60)
        pipe.execute()

    def release(self, worker: str, members: Sequence[str]) -> None:
        if members:
            self._client.zrem(pending_key(self._namespace, worker), *members)

    # --- encode worker ----------------------------------------------------------------------------
    def started(self, worker: str, count: int = 1) -> None:
        self._client.incrby(busy_key(self._namespace, worker), count)

    def finished(self, worker: str, member: str) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.decr(busy_key(self._namespace, worker))
        pipe.zrem(pending_key(self._namespace, worker), member)
        pipe.execute()

    def cached(self, worker: str, tag: str) -> None:
        self._client.sadd(cached_key(self._namespace, worker), tag)

    def evicted(self, worker: str, tag: str) -> None:
        self._client.srem(cached_key(self._namespace, worker), tag)

    def forget_cached(self, worker: str) -> None:
        """Its embedding cache was flushed: nothing of it attracts requests any more."""
        self._client.delete(cached_key(self._namespace, worker))

    def reset_worker(self, worker: str) -> None:
        """A (re)starting encode worker holds nothing and has nothing in progress."""
        self._client.delete(
            cached_key(self._namespace, worker),
            busy_key(self._namespace, worker),
            pending_key(self._namespace, worker),
        )

    def signal_done(self, request_id: str, result: Mapping[str, Any]) -> None:
        key = done_key(self._namespace, request_id)
        pipe = self._client.pipeline(transaction=False)
        pipe.rpush(key, json.dumps(dict(result)))
        pipe.expire(key, DONE_TTL_SECS)
        pipe.execute()

    # --- LLM worker -------------------------------------------------------------------------------
    def wait_done(self, request_id: str, timeout_s: float) -> dict[str, Any] | None:
        """The next per-image result of this request, or None after `timeout_s` (at most a few
        seconds at a time, so the caller can look at the encoder's heartbeat in between)."""
        answer = self._client.blpop([done_key(self._namespace, request_id)], timeout=max(timeout_s, 0.01))
        if answer is None:
            return None
        return json.loads(answer[1])

    def forget_request(self, request_id: str) -> None:
        self._client.delete(done_key(self._namespace, request_id))

    # --- both ---------------------------------------------------------------------------------------
    def count(self, worker: str, counts: Mapping[str, int]) -> None:
        unknown = set(counts) - set(STAT_FIELDS)
        if unknown:
            raise ValueError(f"unknown encoder counters {sorted(unknown)}")
        pipe = self._client.pipeline(transaction=False)
        for field, n in counts.items():
            if n:
                pipe.hincrby(stats_key(self._statistics, worker), field, int(n))
        pipe.execute()

    def snapshot(self, workers: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Per worker: its counters, pending and busy images, and cached entries (one round trip)."""
        workers = sorted(workers)
        now = time.time()
        pipe = self._client.pipeline(transaction=False)
        for worker in workers:
            pipe.hgetall(stats_key(self._statistics, worker))
            pipe.zcount(pending_key(self._namespace, worker), now, "+inf")
            pipe.get(busy_key(self._namespace, worker))
            pipe.scard(cached_key(self._namespace, worker))
        answers = iter(pipe.execute())
        result: dict[str, dict[str, Any]] = {}
        for worker in workers:
            raw = next(answers)
            counters = {field: 0 for field in STAT_FIELDS}
            counters.update({reply_text(k): int(v) for k, v in raw.items() if reply_text(k) in counters})
            result[worker] = {
                **counters,
                "pending": int(next(answers)),
                "busy": max(0, int(next(answers) or 0)),
                "cached_entries": int(next(answers)),
            }
        return result


def summarize(counters: Mapping[str, int]) -> dict[str, float | None]:
    """The figures an operator reads: cache hit rate, bytes and milliseconds per image moved."""
    lookups = counters.get("cache_hits", 0) + counters.get("cache_misses", 0)
    put_images = counters.get("images", 0)
    received = counters.get("received", 0)
    return {
        "embedding_cache_hit_rate": counters.get("cache_hits", 0) / lookups if lookups else None,
        "encode_ms_per_image": counters.get("encode_us", 0) / 1000 / counters.get("cache_misses", 1)
        if counters.get("cache_misses")
        else None,
        "put_bytes_per_image": counters.get("put_bytes", 0) / put_images if put_images else None,
        "put_ms_per_image": counters.get("put_us", 0) / 1000 / put_images if put_images else None,
        "received_bytes_per_image": counters.get("received_bytes", 0) / received if received else None,
        "get_ms_per_image": counters.get("get_us", 0) / 1000 / received if received else None,
        "fallbacks": sum(counters.get(f"fallback_{cause}", 0) for cause in FALLBACK_CAUSES),
    }


def dashboard_section(pool: EncoderPool, roles: Mapping[str, str]) -> dict[str, Any]:
    """E/PD as the dashboard and /metrics show it: per worker of an E/PD role (or with E/PD
    counters) its load, queue, cached entries, counters and per-image figures, and their sum."""
    snapshot = pool.snapshot(roles)
    entries = []
    summed: dict[str, int] = {field: 0 for field in STAT_FIELDS}
    for name, figures in snapshot.items():
        counters = {field: figures[field] for field in STAT_FIELDS}
        for field in STAT_FIELDS:
            summed[field] += counters[field]
        role = roles[name]
        if role == "both" and not any(counters[f] for f in ("images", "received", "tower_forwards")):
            continue
        entries.append(
            {
                "name": name,
                "role": role,
                "pending": figures["pending"],
                "busy": figures["busy"],
                "cached_entries": figures["cached_entries"],
                "counters": counters,
                **summarize(counters),
            }
        )
    return {"workers": entries, "totals": summarize(summed)}
