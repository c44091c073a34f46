"""Routing at fleet scale: the decision's cost (eligibility + decide-and-reserve) at 16, 64, 256
and 1,024 workers, on the real Redis and the frontend's own code.

For each size the bench registers the workers as run_worker does (Worker rows in a database of
its own, heartbeats with an engine report), fills the index with their cached prompts (a shared
system prompt of S, one of I images, a question: Zipf-popular, as bench/routing.py's), then
decides R requests through the frontend's path: `eligible_workers` (the registry as the frontend
reads it per request, unchecked as a request's first decision reads it: the decision checks the
rows' generation), then `areserve_worker` (the router's atomic decide-and-reserve, awaited on the
event loop as a request awaits it), and frees
each lease. It prints, per size: decision p50/p99 split into eligibility and decide, Redis-side
µs per decision, decisions per second one Redis core sustains at that cost, Redis memory per
(block, worker) entry (used-memory delta over the distinct entries, the event stream's last
10,000 events included), and the hit rate against the oracle
(the chosen worker's overlap over the best overlap any worker had).

Redis-side time: the µs Redis spent executing the decision scripts (their EVALSHA calls, which
include every command they call), read from Redis's SLOWLOG with its threshold at 0 for the run:
per command, the same duration INFO commandstats adds up per name, but told apart by script, so
the event publisher's and the lease release's scripts stay out without a read around each
decision. Plus the frontend's background re-reads of the fleet amortized over the decisions (one
re-read's commands, measured apart, times the re-reads made) and the index replica's stream
reads. Nothing is read between decisions, so the loop runs as a frontend's would. A last pass of
COLD_PASS decisions reads INFO commandstats around each one, as this bench did before: it prints
the scripts' µs by both readings (they agree: one measure) beside the run's, and that pass's p50.
The lease's release is not the decision's.

While the frontend decides, the fleet beats as a busy one does (FLEET_BEATS, default on; 0: the
heartbeats stay as registered, as this bench had them before): another process sends each
worker's heartbeat every WORKER_HEARTBEAT_INTERVAL_SECS, the workers' phases spread over the
interval, each beat with its time and a new load. So each of the frontend's re-reads finds about
a quarter of the beats changed (it reads every quarter interval), parses them and writes facts
with the new loads, as a frontend of a working fleet does; printed with the re-reads' wall ms.

Then, per size, FLEET_FRONTENDS (default 1,4) beyond one: that many frontend processes (forked
after the fill, each with connections of its own) decide the same requests between them in an
open loop at FLEET_RATE decisions/s in all (default 200), all starting at once once each has
built its replica: each decision's time runs from when it was due if its frontend was still busy
with the one before (a frontend that cannot keep up shows it), else from when its event loop woke
for it (a timer's wake-up is late by a millisecond or more, a socket's is not); printed with the
decisions per second made in all and per frontend while they decided, and the Redis-side µs per
decision.

Usage: .venv/bin/python bench/fleet.py   (FLEET_SIZES, default 16,64,256,1024; FLEET_DECISIONS,
default 1000). It starts a redis-server of its own (so that INFO counts its commands alone) and
stops it. Figures from a shared machine move from run to run. The last line:
workers=1024 decision_p50_us=… decision_p99_us=… decisions_per_s=… bytes_per_entry=… hit_over_oracle=…
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
_TMP = tempfile.mkdtemp(prefix="bench-fleet-")
# Its database and Redis files go with it (the frontends forked later end without atexit hooks).
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
# A redis-server of the bench's own: INFO commandstats then counts this bench's commands alone,
# not those of whatever else shares the machine's Redis.
from tests.platform_harness import PrivateRedis  # noqa: E402

_REDIS = PrivateRedis(_TMP)
os.environ["REDIS_URL"] = _REDIS.url
os.environ["REDIS_KEY_PREFIX"] = f"bench:fleet:{uuid.uuid4().hex[:8]}:"
os.environ["DATABASE_URL"] = f"sqlite:///{_TMP}/db.sqlite3"
os.environ["DJANGO_SETTINGS_MODULE"] = "inference_platform.settings"
os.environ.setdefault("LOG_LEVELS", "routing=warning")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402

from routing.contract.kv_events import KvEvent  # noqa: E402
from routing.fleet.registry import Heartbeat, WorkerRegistry  # noqa: E402
from routing.kv.events import KvEventPublisher  # noqa: E402
from routing.kv.index import KvIndex  # noqa: E402
from routing.kv.router import CANDIDATES_ABOVE  # noqa: E402
from routing.models import Worker  # noqa: E402
from routing.policy import DEPLOYMENT_POLICY  # noqa: E402
from routing.prompt.hashing import MediaPlacement, block_hashes  # noqa: E402
from routing.state.redis_keys import sync_client  # noqa: E402

SIZES = tuple(int(n) for n in os.environ.get("FLEET_SIZES", "16,64,256,1024").split(","))
DECISIONS = int(os.environ.get("FLEET_DECISIONS", "1000"))
FRONTENDS = tuple(int(n) for n in os.environ.get("FLEET_FRONTENDS", "1,4").split(","))
RATE = float(os.environ.get("FLEET_RATE", "200"))  # decisions/s offered to several frontends, in all
# Each frontend's replica of the index (routing.kv.replica; ROUTER_INDEX_REPLICA): each size above
# CANDIDATES_ABOVE runs without it first, as the baseline, then with it (FLEET_REPLICA=0: once,
# without); at or below, where decisions weigh every worker, a frontend starts none, nor does this.
REPLICA = os.environ.get("FLEET_REPLICA", "1") != "0"
BEATS = os.environ.get("FLEET_BEATS", "1") != "0"
BLOCK_SIZE = 16
MODEL = "bench-model"
SYSTEM_TOKENS, IMAGE_TOKENS, PROMPT_TOKENS = 320, 256, 1_000  # 62 full blocks a prompt
N_SYSTEMS, N_IMAGES = 8, 400
PROMPTS_PER_WORKER = int(os.environ.get("FLEET_PROMPTS_PER_WORKER", "40"))
VOCAB, IMAGE_PAD = 4_096, 4_000


def zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights=weights, k=1)[0]


def prompt_hashes(rng: random.Random, system: list[int], image: int) -> list[int]:
    tokens = [*system, 3, *([IMAGE_PAD] * IMAGE_TOKENS), 4]
    media = [MediaPlacement(routing_hash=image, start=len(system) + 1, length=IMAGE_TOKENS)]
    tokens += [rng.randrange(5, VOCAB - 100) for _ in range(PROMPT_TOKENS - len(tokens))]
    return block_hashes(tokens, BLOCK_SIZE, media)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


SCRIPTS = ("cmdstat_evalsha", "cmdstat_eval")
COLD_PASS = 200  # decisions made again with INFO commandstats around each (see the docstring)


def redis_side_usec(client) -> tuple[float, float]:
    """µs Redis spent so far on scripts (each includes the commands it called), and on every
    command but INFO itself summed by name (which counts a command a script called twice)."""
    stats = client.info("commandstats")
    scripts = sum(stats[name]["usec"] for name in SCRIPTS if name in stats)
    every = sum(
        value["usec"]
        for name, value in stats.items()
        if name.startswith("cmdstat_") and name != "cmdstat_info"
    )
    return scripts, every


class CommandLog:
    """Redis's own account of each command it executes (SLOWLOG at threshold 0): the µs of the
    calls of one script, told apart by its SHA, and of commands by name."""

    def __init__(self, client) -> None:
        self.client = client
        self.saved = client.config_get("slowlog-*")

    def __enter__(self) -> CommandLog:
        self.client.config_set("slowlog-max-len", 1_000_000)
        self.client.config_set("slowlog-log-slower-than", 0)
        self.client.slowlog_reset()
        return self

    def __exit__(self, *exc) -> None:
        for name, value in self.saved.items():
            self.client.config_set(name, value)
        self.client.slowlog_reset()

    def read(self) -> list[tuple[list[bytes], int]]:
        """What ran since the last read (each command's arguments and µs), and forget it."""
        entries = self.client.execute_command("SLOWLOG", "GET", "-1")
        self.client.slowlog_reset()
        return [(entry[3], entry[2]) for entry in entries]

    @staticmethod
    def usec(entries, *, sha: str = "", names: tuple[str, ...] = ()) -> tuple[int, int]:
        """How many of `entries` were calls of the script `sha` (or of the commands `names`), and
        their µs."""
        calls = usec = 0
        for args, duration in entries:
            name = args[0].decode().upper() if args else ""
            if (sha and name == "EVALSHA" and args[1].decode() == sha) or name in names:
                calls, usec = calls + 1, usec + duration
        return calls, usec


def fleet_reread_usec(client) -> float:
    """µs Redis spends on one of a frontend's re-reads of the fleet (no script runs in it, so
    the sum over its commands counts each once)."""
    from inference_platform.serving.dispatch import _read_again

    stats0 = redis_side_usec(client)
    asyncio.run(_read_again(MODEL))
    stats1 = redis_side_usec(client)
    assert stats1[0] == stats0[0], "a fleet read ran a script"
    return stats1[1] - stats0[1]


def _replica_ready(n: int) -> tuple[float, float]:
    """Starts this frontend's replica of the index and waits until it is built: how long that took
    and how much it grew the process (MB of resident memory; 0, 0 when replicas are off, or for a
    fleet of CANDIDATES_ABOVE workers or fewer, whose decisions weigh every worker: a frontend
    starts its replica at its first decision over a larger fleet, and a replica following the
    stream beside decisions that never read it would slow them for nothing)."""
    from inference_platform.serving.frontend import frontend

    replica = frontend().router().replica
    if replica is None or n <= CANDIDATES_ABOVE:
        return 0.0, 0.0
    rss0 = _rss_mb()
    started = time.perf_counter()
    replica.start()
    while not replica.ready:
        time.sleep(0.01)
    return time.perf_counter() - started, _rss_mb() - rss0


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def register(n: int, rng: random.Random) -> list[str]:
    names = [f"sim-{i}" for i in range(n)]
    Worker.objects.all().delete()
    Worker.objects.bulk_create([Worker(name=name, model_name=MODEL, block_size=BLOCK_SIZE) for name in names])
    beats = [
        Heartbeat(
            name=name,
            model=MODEL,
            block_size=BLOCK_SIZE,
            device="sim",
            kv_capacity_blocks=60_000,
            running=rng.randrange(0, 8),
            max_running=256,
            kv_blocks_used=rng.randrange(0, 5_000),
            kv_blocks_free=50_000,
            prefill_tokens_per_s=20_000.0,
            schedule_policy="shortest_first",
        )
        for name in names
    ]
    WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX).beat_many(beats, ttl_s=3_600)
    return names


def run_size(n: int, *, several: bool = True) -> dict[str, float]:
    from inference_platform.serving.dispatch import eligible_workers
    from inference_platform.serving.frontend import frontend
    from inference_platform.serving.prepare import areserve_worker

    rng = random.Random(20261203 + n)
    client = sync_client(settings.REDIS_URL)
    namespace = settings.REDIS_KEY_PREFIX
    for key in client.scan_iter(match=f"{namespace}*", count=5_000):
        client.unlink(key)
    frontend().reset()
    names = register(n, rng)
    systems = [[rng.randrange(5, VOCAB - 100) for _ in range(SYSTEM_TOKENS)] for _ in range(N_SYSTEMS)]
    images = [rng.getrandbits(64) for _ in range(N_IMAGES)]
    # Each worker caches prompts about the images routed to it: an image lives on a few workers.
    index = KvIndex(client, namespace)
    publisher = KvEventPublisher(client, namespace, index=index)
    before = client.info("memory")["used_memory"]
    entries = 0  # distinct (block, worker) pairs: a worker storing a block it holds adds none
    held: dict[int, list[int]] = {}  # image -> one of its cached prompts' hashes
    for w, name in enumerate(names):
        blocks: set[int] = set()
        for _ in range(PROMPTS_PER_WORKER):
            image = (zipf(rng, N_IMAGES) + w) % N_IMAGES
            hashes = prompt_hashes(rng, systems[image % N_SYSTEMS], images[image])
            held.setdefault(image, hashes)
            publisher.publish([KvEvent("stored", name, tuple(hashes))])
            blocks.update(hashes)
        entries += len(blocks)
    bytes_per_entry = (client.info("memory")["used_memory"] - before) / entries

    requests = []
    for _ in range(DECISIONS):
        image = zipf(rng, N_IMAGES)
        cached = held.get(image)
        # a repeat of a cached prompt's image with a new question: its prefix is somewhere
        requests.append(cached[:40] + prompt_hashes(rng, [7] * SYSTEM_TOKENS, 1)[40:] if cached else cached)
    requests = [r for r in requests if r]

    from inference_platform.serving import dispatch

    rereads: list[float] = []  # each re-read's wall ms
    read_again = dispatch._read_again

    async def counted_read_again(model: str):
        started = time.perf_counter()
        try:
            return await read_again(model)
        finally:
            rereads.append((time.perf_counter() - started) * 1e3)

    async def decide_all(
        batch: list[list[int]], *, info_around_each: bool = False
    ) -> tuple[list[float], list[float], float, int, int]:
        """Decides `batch`: each decision's eligibility and decide µs, the scripts' µs INFO
        commandstats saw around the decisions (`info_around_each`; 0 otherwise), and the chosen
        and best overlaps summed over every tenth decision."""
        eligibility, decide, info_us, chosen, oracle = [], [], 0.0, 0, 0
        events: list[KvEvent] = []
        everyone = list(names)
        for k, hashes in enumerate(batch):
            sampled = k % 10 == 0
            if sampled:  # the oracle (before the decision predicts its blocks somewhere), untimed
                overlaps = index.overlaps(hashes, everyone)
                oracle_best = max(overlaps.values()) if overlaps else 0
            if info_around_each:
                usec0 = redis_side_usec(client)[0]
            t0 = time.perf_counter()
            workers = await eligible_workers(MODEL, BLOCK_SIZE, checked=False)
            t1 = time.perf_counter()
            prepared = types.SimpleNamespace(
                view=types.SimpleNamespace(
                    block_hashes=hashes, prompt_tokens=PROMPT_TOKENS, block_size=BLOCK_SIZE
                ),
                policy=DEPLOYMENT_POLICY,
            )
            lease = await areserve_worker(prepared, workers, None, f"bench-{k}-{info_around_each}")
            t2 = time.perf_counter()
            if info_around_each:
                info_us += redis_side_usec(client)[0] - usec0
            eligibility.append((t1 - t0) * 1e6)
            decide.append((t2 - t1) * 1e6)
            if sampled:
                chosen += lease.decision.overlap
                oracle += oracle_best
            lease.release("done")
            # The chosen worker computes the prompt and announces its blocks, as a worker does
            # (in batches of a few): the replicas of the index read them while decisions go on.
            events.append(KvEvent("stored", lease.worker, tuple(hashes)))
            if len(events) == 4:
                publisher.publish(events)
                events.clear()
        return eligibility, decide, info_us, chosen, oracle

    # Forked before this process starts its replica's thread; it beats only while decisions run.
    fork = multiprocessing.get_context("fork")
    start_beats, stop_beats = fork.Event(), fork.Event()
    beater = fork.Process(target=_beating, args=(names, start_beats, stop_beats), daemon=True)
    if BEATS:
        beater.start()
    asyncio.run(_warm(eligible_workers))
    replica_build_s, replica_mb = _replica_ready(n)
    decision_sha = frontend().router()._decision.sha
    dispatch._read_again = counted_read_again
    start_beats.set()
    try:
        with CommandLog(client) as log:
            eligibility, decide, _, chosen, oracle = asyncio.run(decide_all(requests))
            ran = log.read()
            cold = requests[:COLD_PASS]
            cold_run = asyncio.run(decide_all(cold, info_around_each=True))
            cold_eligibility, cold_decide, cold_info_us = cold_run[:3]
            cold_ran = log.read()
    finally:
        dispatch._read_again = read_again
        stop_beats.set()
        if BEATS:
            beater.join(timeout=30)
    decisions, scripts_total = CommandLog.usec(ran, sha=decision_sha)
    # A decision whose fleet read went stale (the rows moved) runs the script again: both count.
    assert decisions >= len(requests), f"{decisions} decision scripts logged for {len(requests)} decisions"
    replica_us = CommandLog.usec(ran, names=("XREAD", "XINFO"))[1] / len(requests)
    cold_logged_us = CommandLog.usec(cold_ran, sha=decision_sha)[1]
    reread_us = fleet_reread_usec(client)
    redis_us = (scripts_total + len(rereads) * reread_us) / len(requests) + replica_us
    total = [e + d for e, d in zip(eligibility, decide, strict=True)]
    cold_total = [e + d for e, d in zip(cold_eligibility, cold_decide, strict=True)]
    several = {f: several_frontends(f, n, requests, client) for f in FRONTENDS if f > 1} if several else {}
    return {
        "several": several,
        "workers": n,
        "entries": entries,
        "eligibility_p50": percentile(eligibility, 0.5),
        "decide_p50": percentile(decide, 0.5),
        "p50": percentile(total, 0.5),
        "p99": percentile(total, 0.99),
        "redis_us": redis_us,
        "script_us": scripts_total / len(requests),
        "cold_p50": percentile(cold_total, 0.5),
        "cold_script_us": cold_logged_us / len(cold),  # per decision, as INFO's reading beside it
        "cold_info_us": cold_info_us / len(cold),
        "rereads": len(rereads),
        "reread_ms": statistics.median(rereads) if rereads else 0.0,
        "replica_us": replica_us,
        "replica_build_s": replica_build_s,
        "replica_mb": replica_mb,
        "reread_us": reread_us,
        "decisions_per_s": 1e6 / redis_us,
        "bytes_per_entry": bytes_per_entry,
        "hit_over_oracle": chosen / oracle if oracle else 1.0,
    }


def several_frontends(count: int, n: int, requests: list[list[int]], client) -> dict[str, float]:
    """`count` frontend processes (forked from this one: the index and the fleet as filled) decide
    the requests between them, each at RATE / count decisions per second in an open loop (the
    module's docstring says from when a decision's time runs). Redis-side
    time: the decision scripts' µs in Redis's command log (CommandLog), over the decisions (the
    children's background re-reads left out here, see run_size)."""
    from django.db import connections

    from inference_platform.serving.frontend import frontend

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    connections.close_all()  # each child opens its own
    decision_sha = frontend().router()._decision.sha
    ready = context.Barrier(count)
    with CommandLog(client) as log:
        children = [
            context.Process(target=_frontend_process, args=(i, count, n, requests[i::count], results, ready))
            for i in range(count)
        ]
        for child in children:
            child.start()
        latencies: list[float] = []
        first, last = float("inf"), 0.0
        for _ in children:
            answer = results.get(timeout=600)
            if isinstance(answer, BaseException):
                raise RuntimeError(f"a frontend process failed: {answer!r}")
            latencies += answer[0]
            first, last = min(first, answer[1]), max(last, answer[2])
        for child in children:
            child.join()
        wall = last - first  # the deciding, not the frontends' start (monotonic: one clock for all)
        redis_us = CommandLog.usec(log.read(), sha=decision_sha)[1] / len(latencies)
    return {
        "p50": percentile(latencies, 0.5),
        "p99": percentile(latencies, 0.99),
        "done_per_s": len(latencies) / wall,
        "redis_us": redis_us,
    }


def _frontend_process(i: int, count: int, n: int, requests: list[list[int]], results, ready) -> None:
    from asgiref.sync import SyncToAsync

    from inference_platform.serving.dispatch import eligible_workers, forget_fleet_read
    from inference_platform.serving.frontend import frontend
    from inference_platform.serving.prepare import areserve_worker

    # A forked child has none of its parent's threads: asgiref's one thread for the ORM (created
    # in the parent) would never run what the fleet read asks of the database.
    SyncToAsync.single_thread_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    frontend().reset()  # connections of its own, not the parent's
    forget_fleet_read()
    interval = count / RATE

    async def run() -> tuple[list[float], float, float]:
        _replica_ready(n)
        # Every frontend starts deciding at once (a replica takes seconds to build), each one's
        # arrivals falling between the others', with a fleet read made then: one made before
        # the wait would be stale by the first decision, and every frontend would read the fleet
        # again inside its first timed decisions at the same moment.
        ready.wait()
        await _warm(eligible_workers)
        latencies = []
        start = time.perf_counter() + 0.05 + i * interval / count
        finished = start
        for k, hashes in enumerate(requests):
            due = start + k * interval
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            # From when it was due if the frontend was still busy then (its queue counts), else
            # from when the loop woke for it: a timer's wake-up is rounded up to the millisecond
            # and more, where a request's arrival on a socket wakes the loop at once.
            began = due if finished > due else time.perf_counter()
            workers = await eligible_workers(MODEL, BLOCK_SIZE, checked=False)
            prepared = types.SimpleNamespace(
                view=types.SimpleNamespace(
                    block_hashes=hashes, prompt_tokens=PROMPT_TOKENS, block_size=BLOCK_SIZE
                ),
                policy=DEPLOYMENT_POLICY,
            )
            lease = await areserve_worker(prepared, workers, None, f"bench-{i}-{k}")
            latencies.append((time.perf_counter() - began) * 1e6)
            lease.release("done")
            finished = time.perf_counter()
        return latencies, start, finished

    try:
        results.put(asyncio.run(run()))
    except BaseException as exc:  # the parent waits for every child's answer
        results.put(exc)
        raise


BEAT_PHASES = 20  # the interval's slices: each slice's workers beat together


def _beating(names: list[str], start, stop) -> None:
    """The fleet's workers beating from `start` until `stop` (multiprocessing events), each every
    heartbeat interval at its own phase, with the time of the beat and a new load: what `register`
    wrote, made again as a working fleet's beats are. A process of its own, as the workers are:
    the frontend's process does none of it."""
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)  # not the parent's connections
    registry = WorkerRegistry(client, settings.REDIS_KEY_PREFIX)
    beats = list(registry.alive(names).values())
    rng = random.Random(20261207)
    start.wait()
    interval, k = settings.WORKER_HEARTBEAT_INTERVAL_SECS, 0
    while not stop.wait(interval / BEAT_PHASES):
        due = beats[k % BEAT_PHASES :: BEAT_PHASES]
        registry.beat_many(
            [
                dataclasses.replace(
                    beat,
                    beat_at=time.time(),
                    running=rng.randrange(0, 8),
                    kv_blocks_used=rng.randrange(0, 5_000),
                )
                for beat in due
            ],
            ttl_s=3_600,
        )
        k += 1
    client.close()


async def _warm(eligible_workers) -> None:
    for _ in range(3):
        await eligible_workers(MODEL, BLOCK_SIZE)


def main() -> None:
    call_command("migrate", verbosity=0)
    print("one frontend (in process), one Redis; a shared machine: figures move from run to run")
    print(
        f"{'workers':>8}{'entries':>11}{'elig p50':>10}{'decide p50':>12}{'p50 us':>9}{'p99 us':>9}"
        f"{'redis us':>10}{'decisions/s':>13}{'B/entry':>9}{'hit/oracle':>12}"
    )
    rows = []
    try:
        for n in SIZES:
            replica_used = REPLICA and n > CANDIDATES_ABOVE
            if replica_used:
                settings.ROUTER_INDEX_REPLICA = False
                without = run_size(n, several=False)
            settings.ROUTER_INDEX_REPLICA = REPLICA
            row = run_size(n)
            rows.append(row)
            print(
                f"{row['workers']:>8}{row['entries']:>11,}{row['eligibility_p50']:>10.0f}{row['decide_p50']:>12.0f}"
                f"{row['p50']:>9.0f}{row['p99']:>9.0f}{row['redis_us']:>10.0f}"
                f"{row['decisions_per_s']:>13,.0f}{row['bytes_per_entry']:>9.1f}{row['hit_over_oracle']:>12.3f}"
            )
            print(
                f"{'':>8}fleet re-reads: {row['rereads']} of {row['reread_us']:.0f} us each, "
                f"and the index replica's reads of the stream, {row['replica_us']:.0f} us a decision, "
                f"in the redis us above; a re-read took {row['reread_ms']:.1f} ms of wall time "
                f"({'the workers beating' if BEATS else 'heartbeats unchanged'})"
            )
            print(
                f"{'':>8}{COLD_PASS} decisions more with INFO commandstats around each (the earlier method): "
                f"their scripts {row['cold_info_us']:.0f} us by INFO, {row['cold_script_us']:.0f} us by the "
                f"command log (the run's: {row['script_us']:.0f} us), p50 {row['cold_p50']:.0f} us"
            )
            if REPLICA and not replica_used:
                print(
                    f"{'':>8}index replica: not started (decisions over a fleet of {CANDIDATES_ABOVE} "
                    "workers or fewer weigh every worker; a frontend starts it above that)"
                )
            elif REPLICA:
                print(
                    f"{'':>8}index replica: built in {row['replica_build_s']:.1f} s, "
                    f"{row['replica_mb']:.0f} MB; without it (candidates found in Redis): "
                    f"p50 {without['p50']:.0f} us, p99 {without['p99']:.0f} us, "
                    f"redis {without['redis_us']:.0f} us, hit/oracle {without['hit_over_oracle']:.3f}; "
                    f"with it over without: p50 {row['p50'] / without['p50']:.2f}x, "
                    f"redis {row['redis_us'] / without['redis_us']:.2f}x"
                )
            for count, figures in row["several"].items():
                print(
                    f"{'':>8}{count} frontends, open loop at {RATE:.0f}/s: p50 {figures['p50']:.0f} us, "
                    f"p99 {figures['p99']:.0f} us, {figures['done_per_s']:.0f} decisions/s in all "
                    f"({figures['done_per_s'] / count:.0f} per frontend), "
                    f"redis {figures['redis_us']:.0f} us each"
                )
    finally:
        from inference_platform.serving.frontend import frontend

        frontend().reset()  # its replica's thread stops before its Redis does
        _REDIS.stop()
    by = {row["workers"]: row for row in rows}
    if 64 in by and max(by) > 64:
        print(f"p50 at {max(by)} workers over p50 at 64: {by[max(by)]['p50'] / by[64]['p50']:.2f}x")
    last = rows[-1]
    print(
        f"workers={last['workers']} decision_p50_us={last['p50']:.0f} decision_p99_us={last['p99']:.0f} "
        f"decisions_per_s={last['decisions_per_s']:.0f} bytes_per_entry={last['bytes_per_entry']:.1f} "
        f"hit_over_oracle={last['hit_over_oracle']:.3f}"
    )


if __name__ == "__main__":
    main()
