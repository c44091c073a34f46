"""Which way of summing metrics across processes is cheaper: ours (record in memory, flush to
Redis once a second, scrape reads one hash) or prometheus_client's multiprocess mode (each
observe writes an mmap'ed file; a scrape reads every process's files on this host).

Measured per observation on the request path (a TTFT histogram, labelled by worker) and per
scrape with PROCESSES processes' worth of series. Needs the local Redis (db 13, its own prefix,
removed after).

Run: .venv/bin/python bench/metrics.py [--observations 100000] [--processes 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the repo root

import redis

from routing.observe import telemetry
from routing.observe.telemetry import MetricsRecorder

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
WORKERS = [f"gpu{i}" for i in range(4)]

# One process of prometheus_client's multiprocess mode: the mode is fixed at import, from the
# environment, so it runs in a child with PROMETHEUS_MULTIPROC_DIR set.
_MULTIPROC_CHILD = r"""
import json, sys, time
from prometheus_client import Histogram
from routing.observe.metric_catalog import LATENCY_BUCKETS
n, workers = int(sys.argv[1]), sys.argv[2].split(",")
ttft = Histogram("mmr_ttft_seconds", "TTFT", ["worker"], buckets=LATENCY_BUCKETS)
children = [ttft.labels(worker=w) for w in workers]
start = time.perf_counter()
for i in range(n):
    children[i % len(children)].observe((i % 997) / 1000)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

_MULTIPROC_SCRAPE = r"""
import json, time
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
registry = CollectorRegistry()
MultiProcessCollector(registry)
start = time.perf_counter()
runs = 20
for _ in range(runs):
    generate_latest(registry)
print(json.dumps({"seconds": (time.perf_counter() - start) / runs}))
"""


def ours(
    observations: int, processes: int, client: redis.Redis, namespace: str
) -> tuple[float, float, float]:
    """(record µs per observation, flush ms per second's worth, scrape ms)."""
    recorders = [MetricsRecorder(client, namespace, source=f"p{i}") for i in range(processes)]
    recorder = recorders[0]
    start = time.perf_counter()
    for i in range(observations):
        recorder.observe(
            "ttft_seconds", (i % 997) / 1000, labels={"worker": WORKERS[i % len(WORKERS)], "model": "demo"}
        )
    record = (time.perf_counter() - start) / observations * 1e6
    start = time.perf_counter()
    recorder.flush()  # what the background thread does once a second, off the request path
    flush = (time.perf_counter() - start) * 1000
    for other in recorders[1:]:
        for i in range(1000):
            other.observe(
                "ttft_seconds",
                (i % 997) / 1000,
                labels={"worker": WORKERS[i % len(WORKERS)], "model": "demo"},
            )
        other.flush()
    from inference_platform.metrics import render_metrics, telemetry_families

    runs = 20
    start = time.perf_counter()
    for _ in range(runs):
        totals = telemetry.read_totals(client, namespace)
        render_metrics(list(telemetry_families(totals, {})))
    scrape = (time.perf_counter() - start) / runs * 1000
    for r in recorders:
        r.close()
    return record, flush, scrape


def multiprocess(observations: int, processes: int) -> tuple[float, float]:
    """(record µs per observation, scrape ms) in prometheus_client's multiprocess mode."""
    repo = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": folder, "PYTHONPATH": repo}
        timed = subprocess.run(
            [sys.executable, "-c", _MULTIPROC_CHILD, str(observations), ",".join(WORKERS)],
            env=env, capture_output=True, text=True, check=True, timeout=300,
        )  # fmt: skip
        record = json.loads(timed.stdout)["seconds"] / observations * 1e6
        for _ in range(processes - 1):  # the other processes' files, as a scrape finds them
            subprocess.run(
                [sys.executable, "-c", _MULTIPROC_CHILD, "1000", ",".join(WORKERS)],
                env=env, capture_output=True, text=True, check=True, timeout=120,
            )  # fmt: skip
        scraped = subprocess.run(
            [sys.executable, "-c", _MULTIPROC_SCRAPE],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        return record, json.loads(scraped.stdout)["seconds"] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--observations", type=int, default=100_000)
    parser.add_argument("--processes", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    import django

    django.setup()

    client = redis.Redis.from_url(REDIS_URL)
    namespace = f"bench:metrics:{uuid.uuid4().hex[:8]}:"
    try:
        record, flush, scrape = ours(args.observations, args.processes, client, namespace)
    finally:
        for key in client.scan_iter(match=f"{namespace}*"):
            client.delete(key)
    mp_record, mp_scrape = multiprocess(args.observations, args.processes)

    print(f"{'':<34}{'record µs/obs':>14}{'scrape ms':>11}")
    print(f"{'Redis-summed (routing.observe.telemetry)':<34}{record:>14.2f}{scrape:>11.2f}")
    print(f"{'prometheus_client multiprocess':<34}{mp_record:>14.2f}{mp_scrape:>11.2f}")
    print(
        f"(ours also flushes once a second off the request path: {flush:.1f} ms for {args.observations} obs)"
    )
    print(
        f"record: ours/multiprocess = {record / mp_record:.2f}x; "
        f"scrape with {args.processes} processes: ours/multiprocess = {scrape / mp_scrape:.2f}x"
    )


if __name__ == "__main__":
    main()
