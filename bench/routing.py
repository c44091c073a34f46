"""Router benchmark on the real Redis: index fill rate, whole-decision latency against a Redis
round trip, and one 240,000-token decision over 96 workers.

Run: `.venv/bin/python bench/routing.py` (REDIS_URL, default redis://127.0.0.1:6379/14). It
works in a namespace of its own and deletes every key it wrote. The last line is the summary.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routing.contract.kv_events import KvEvent
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.kv.decision import WorkerReport
from routing.kv.events import KvEventPublisher
from routing.kv.index import BUCKET_FAMILY, KvIndex
from routing.kv.load import LoadTracker
from routing.kv.router import KvRouter
from routing.kv.selection import RoutingPolicy
from routing.prompt.hashing import MediaPlacement, block_hashes
from routing.prompt.layouts import layout_for_config
from routing.prompt.token_view import ImageFacts, build_token_view

BLOCK_SIZE = 16
PROMPT_TOKENS = 2_000
SYSTEM_TOKENS = 480  # a system prompt shared by many prompts
IMAGE_TOKENS = 400  # one 560x560 image on Qwen2-VL
IMAGE_SIZE = (560, 560)
N_WORKERS = 64
N_SYSTEM_PROMPTS = 24
N_IMAGES = 300
N_PROMPTS = 6_000  # distinct cached prompts, held unevenly (Zipf) by the workers
PROMPTS_PER_WORKER = 130  # 64 x 130 x 125 blocks ~ 1.04 M stored blocks
EVENTS_PER_PUBLISH = 16
N_DECISIONS = 2_000
LONG_TOKENS = 240_000
LONG_WORKERS = 96
VOCAB = 4_096
IMAGE_PAD = 4_000


def zipf_choice(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = getattr(zipf_choice, "_w", {}).get((n, s))
    if weights is None:
        weights = [1 / (k + 1) ** s for k in range(n)]
        zipf_choice._w = {**getattr(zipf_choice, "_w", {}), (n, s): weights}  # type: ignore[attr-defined]
    return rng.choices(range(n), weights=weights, k=1)[0]


def make_prompt(
    rng: random.Random, system: list[int], image_hash: int, tail_tokens: int
) -> tuple[list[int], list[MediaPlacement]]:
    """System prompt, one image's placeholders, then user text."""
    tokens = [*system, 3, *([IMAGE_PAD] * IMAGE_TOKENS), 4]
    media = [MediaPlacement(routing_hash=image_hash, start=len(system) + 1, length=IMAGE_TOKENS)]
    tokens += [rng.randrange(5, VOCAB - 100) for _ in range(tail_tokens - len(tokens))]
    return tokens, media


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    client = redis.Redis.from_url(url)
    namespace = f"bench:routing:{uuid.uuid4().hex[:8]}:"
    rng = random.Random(20260517)
    summary = ""
    try:
        summary = run(client, namespace, rng)
    finally:
        deleted = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{namespace}*", count=5_000):
            batch.append(key)
            if len(batch) >= 5_000:
                deleted += client.unlink(*batch)
                batch.clear()
        if batch:
            deleted += client.unlink(*batch)
        print(f"{'keys deleted afterwards':44} {deleted:>14,}")
    print(summary)


def run(client: redis.Redis, namespace: str, rng: random.Random) -> str:
    registry = WorkerRegistry(client, namespace)
    workers = [f"gpu{i}" for i in range(LONG_WORKERS)]
    for name in workers:
        registry.beat(Heartbeat(name=name, model="demo-qwen2-vl", block_size=BLOCK_SIZE), ttl_s=600)
    main_workers = list(registry.alive(workers[:N_WORKERS]))
    assert len(main_workers) == N_WORKERS

    index = KvIndex(client, namespace)
    publisher = KvEventPublisher(client, namespace, index=index)
    load = LoadTracker(client, namespace)
    router = KvRouter(client, namespace, index=index, load=load)
    policy = RoutingPolicy()
    # What the frontend passes with every decision: each worker's heartbeat report (its engine's
    # load and measured prefill rate, so the script drains reservations as it does in serving).
    reports = {
        name: WorkerReport(
            capacity_blocks=4_096, running_and_waiting=4, kv_used_blocks=600, prefill_tokens_per_s=2_000.0
        )
        for name in workers
    }

    # --- the cached prompts and who holds them -------------------------------------------------
    t0 = time.perf_counter()
    systems = [[rng.randrange(5, VOCAB - 100) for _ in range(SYSTEM_TOKENS)] for _ in range(N_SYSTEM_PROMPTS)]
    images = [rng.getrandbits(64) for _ in range(N_IMAGES)]
    prompts = []
    for _ in range(N_PROMPTS):
        tokens, media = make_prompt(
            rng,
            systems[zipf_choice(rng, N_SYSTEM_PROMPTS)],
            images[zipf_choice(rng, N_IMAGES)],
            PROMPT_TOKENS,
        )
        prompts.append((tokens, media, block_hashes(tokens, BLOCK_SIZE, media)))
    prep_s = time.perf_counter() - t0

    events = []
    for worker in main_workers:
        held = {zipf_choice(rng, N_PROMPTS, 0.8) for _ in range(PROMPTS_PER_WORKER * 2)}
        for p in list(held)[:PROMPTS_PER_WORKER]:
            events.append(KvEvent("stored", worker, tuple(prompts[p][2])))
    rng.shuffle(events)
    stored_blocks = sum(len(e.block_hashes) for e in events)
    t0 = time.perf_counter()
    for i in range(0, len(events), EVENTS_PER_PUBLISH):
        publisher.publish(events[i : i + EVENTS_PER_PUBLISH])
    fill_s = time.perf_counter() - t0
    # A block is a field of one bucket (routing/kv/index.py), whatever its number of holders.
    distinct_blocks = sum(
        client.hlen(key) for key in client.scan_iter(match=f"{namespace}{BUCKET_FAMILY}*", count=10_000)
    )

    # Some requests in flight, so the load terms are not all zero.
    for i in range(256):
        load.add(rng.choice(main_workers), f"inflight-{i}", rng.randrange(0, 2_000), 125)

    # --- whole decisions for ~2,000-token requests with one image ------------------------------
    # Each request is what the frontend has after tokenizing the chat template's output: one
    # placeholder per image. The timed decision starts there: the token view (placeholder
    # expansion by the family's layout), block hashes, index query, load and selection.
    layout = layout_for_config({"model_type": "qwen2_vl"}, None)
    assert layout is not None and layout.image_tokens(*IMAGE_SIZE) == IMAGE_TOKENS
    requests = []
    for _ in range(N_DECISIONS):
        base_tokens, base_media, _ = prompts[zipf_choice(rng, N_PROMPTS, 0.8)]
        keep = rng.choice((SYSTEM_TOKENS, SYSTEM_TOKENS + IMAGE_TOKENS + 2, 1_200, 1_800))
        tokens = base_tokens[:keep] + [rng.randrange(5, VOCAB - 100) for _ in range(PROMPT_TOKENS - keep)]
        start = base_media[0].start
        prompt_ids = [*tokens[:start], IMAGE_PAD, *tokens[start + IMAGE_TOKENS :]]
        image_hash = base_media[0].routing_hash
        facts = ImageFacts(f"{image_hash:016x}{0:016x}", image_hash, *IMAGE_SIZE)
        requests.append((prompt_ids, facts))
    decision_us, hashing_us, rtt_us, overlaps = [], [], [], []
    scripts_before = client.info("commandstats").get("cmdstat_evalsha", {})
    for prompt_ids, facts in requests:
        t = time.perf_counter_ns()
        client.ping()
        rtt_us.append((time.perf_counter_ns() - t) / 1_000)
        t = time.perf_counter_ns()
        view = build_token_view(
            prompt_ids, [facts], layout=layout, placeholder_id=IMAGE_PAD, block_size=BLOCK_SIZE
        )
        hashes = view.block_hashes
        t_hashed = time.perf_counter_ns()
        decision = router.route(
            hashes, view.prompt_tokens, BLOCK_SIZE, main_workers, policy, reports=reports, rng=rng
        )
        decision_us.append((time.perf_counter_ns() - t) / 1_000)
        hashing_us.append((t_hashed - t) / 1_000)
        overlaps.append(decision.overlap / decision.total_blocks)

    # Time inside Redis (its own count, so other clients' scripts in the same window would show).
    scripts_after = client.info("commandstats").get("cmdstat_evalsha", {})
    script_calls = scripts_after.get("calls", 0) - scripts_before.get("calls", 0)
    script_us = (scripts_after.get("usec", 0) - scripts_before.get("usec", 0)) / max(script_calls, 1)

    # --- one 240,000-token request against 96 workers, its prefix partly cached ----------------
    long_tokens = [rng.randrange(5, VOCAB - 100) for _ in range(LONG_TOKENS)]
    long_media = [MediaPlacement(routing_hash=images[0], start=SYSTEM_TOKENS, length=IMAGE_TOKENS)]
    long_hashes = block_hashes(long_tokens, BLOCK_SIZE, long_media)
    n_long = len(long_hashes)
    long_events = []
    for i, worker in enumerate(workers):
        # A few workers hold deep prefixes (25-90 %), the others the first ~2,000 tokens.
        depth = int(n_long * (0.25 + 0.65 * i / 7)) if i < 8 else 125
        for start in range(0, depth, 2_000):
            long_events.append(
                KvEvent("stored", worker, tuple(long_hashes[start : min(depth, start + 2_000)]))
            )
    for event in long_events:
        publisher.publish([event])
    long_hash_ms, long_route_ms, long_total_ms = [], [], []
    for _ in range(7):
        t = time.perf_counter_ns()
        hashes = block_hashes(long_tokens, BLOCK_SIZE, long_media)
        t_hash = time.perf_counter_ns()
        decision = router.route(hashes, LONG_TOKENS, BLOCK_SIZE, workers, policy, reports=reports, rng=rng)
        t_end = time.perf_counter_ns()
        long_hash_ms.append((t_hash - t) / 1e6)
        long_route_ms.append((t_end - t_hash) / 1e6)
        long_total_ms.append((t_end - t) / 1e6)
    assert decision.overlap == int(n_long * 0.9), decision.overlap

    info = client.info("memory")
    d50, d99 = percentile(decision_us, 0.5), percentile(decision_us, 0.99)
    r50 = percentile(rtt_us, 0.5)
    print(f"{'metric':44} {'value':>14}")
    rows = [
        ("workers (decisions / long prompt)", f"{N_WORKERS} / {LONG_WORKERS}"),
        ("prompt hashing for the fill (s)", f"{prep_s:.2f}"),
        ("stored blocks published", f"{stored_blocks:,}"),
        ("distinct blocks in the index", f"{distinct_blocks:,}"),
        ("fill time (s)", f"{fill_s:.2f}"),
        ("fill rate (events/s)", f"{len(events) / fill_s:,.0f}"),
        ("fill rate (blocks/s)", f"{stored_blocks / fill_s:,.0f}"),
        ("redis used memory (MB)", f"{info['used_memory'] / 1e6:,.0f}"),
        ("decisions timed", f"{N_DECISIONS}"),
        ("decision p50 / p99 (us)", f"{d50:.0f} / {d99:.0f}"),
        ("  of which token view + block hashing p50 (us)", f"{percentile(hashing_us, 0.5):.0f}"),
        (
            "  of which route() p50 (us)",
            f"{percentile([d - h for d, h in zip(decision_us, hashing_us, strict=True)], 0.5):.0f}",
        ),
        ("  of which the script inside Redis, mean (us)", f"{script_us:.0f}"),
        ("redis PING rtt p50 / p99 (us)", f"{r50:.0f} / {percentile(rtt_us, 0.99):.0f}"),
        ("mean chosen overlap (fraction)", f"{statistics.mean(overlaps):.2f}"),
        ("long prompt blocks / overlap", f"{n_long} / {decision.overlap}"),
        ("long prompt hashing p50 (ms)", f"{statistics.median(long_hash_ms):.1f}"),
        ("long prompt route p50 (ms)", f"{statistics.median(long_route_ms):.1f}"),
        ("long prompt whole decision p50 (ms)", f"{statistics.median(long_total_ms):.1f}"),
    ]
    for name, value in rows:
        print(f"{name:44} {value:>14}")
    return (
        f"decision_p50_us={d50:.0f} decision_p99_us={d99:.0f} redis_rtt_p50_us={r50:.0f} "
        f"ratio_p50={d50 / r50:.2f} long_prompt_ms={statistics.median(long_total_ms):.1f}"
    )


if __name__ == "__main__":
    main()
