"""Metrics and window figures across real processes: two workers, a frontend, an image origin.

The platform is shared by this module's tests and the browser test (`observed_platform`); each
test compares what the platform shows with the ledger of everything the tests sent to it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from routing.observe.cache_stats import CacheStats
from routing.observe.telemetry import MetricsRecorder
from tests.observed_platform import WORKERS, ObservedPlatform

WINDOW_MINUTES = 60
HISTORY_AGE_S = 3 * 3600  # outside the window, inside the day the minute buckets are kept


def eventually(read: Callable[[], Any], check: Callable[[Any], bool], timeout: float = 20.0) -> Any:
    """`read()` once `check` holds of it (processes flush their counts about once a second)."""
    deadline = time.monotonic() + timeout
    value = read()
    while not check(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = read()
    return value


def window_matches(snapshot: dict[str, Any], platform: ObservedPlatform) -> bool:
    sent = platform.ledger
    totals, kv = snapshot["window"]["totals"], snapshot["window"]["caches"]["kv"]
    return (
        totals["requests"],
        totals["prompt_tokens"],
        totals["cached_prompt_tokens"],
        kv["hits"],
        kv["cached_tokens"],
        kv["prompt_tokens"],
    ) == (
        sent.requests,
        sent.prompt_tokens,
        sent.cached_tokens,
        sent.kv_hits,
        sent.cached_tokens,
        sent.prompt_tokens,
    )


def test_window_figures_equal_what_was_sent_in_the_window_and_not_the_history_before_it(
    observed_platform: ObservedPlatform,
) -> None:
    platform = observed_platform
    redis_client, namespace = platform.processes.redis, platform.processes.statistics_namespace
    # given: requests answered three hours ago, recorded by the classes the processes record with
    # (their own clocks put them there; the platform's processes cannot be sent back in time)
    then = time.time() - HISTORY_AGE_S
    history = MetricsRecorder(redis_client, namespace, source="web:history", clock=lambda: then)
    history.inc("requests", 7, labels={"status": "200", "worker": WORKERS[0], "model": "demo"})
    history.inc("prompt_tokens", 700, labels={"worker": WORKERS[0], "model": "demo"})
    history.inc("cached_prompt_tokens", 300, labels={"worker": WORKERS[0], "model": "demo"})
    history.close()
    platform.ledger.history_requests += 7
    old_counts = CacheStats(redis_client, namespace, WORKERS[0], clock=lambda: then)
    old_counts.incr("kv", "hits", 5)
    old_counts.incr("kv", "cached_tokens", 300)
    old_counts.incr("kv", "prompt_tokens", 700)
    old_counts.close()

    # when: requests with repeated images, now
    for image in (0, 0, 1, 0, 1):
        response = platform.send(image)
        assert response.status_code == 200, response.text
    assert platform.ledger.kv_hits, "a repeated image found its cached prefix"

    # then: routing_stats and the dashboard's JSON show exactly what was sent in the window
    def routing_stats() -> dict[str, Any]:
        return json.loads(platform.manage("routing_stats", "--json", "--minutes", str(WINDOW_MINUTES)))

    stats = eventually(routing_stats, lambda s: window_matches(s, platform))
    assert window_matches(stats, platform), (stats["window"]["totals"], platform.ledger)
    staff = platform.staff_session()
    try:
        dashboard = staff.get(f"/admin/dashboard.json?minutes={WINDOW_MINUTES}").json()
    finally:
        staff.close()
    assert window_matches(dashboard, platform), (dashboard["window"]["totals"], platform.ledger)
    assert dashboard["window"]["totals"]["by_status"] == {
        str(status): n for status, n in sorted(platform.ledger.statuses.items())
    }
    # the router's quality figure: repeated images had a best eligible overlap, some or all kept
    routing = dashboard["window"]["totals"]
    assert routing["best_overlap_blocks"] > 0
    assert 0 <= routing["overlap_given_up_blocks"] <= routing["best_overlap_blocks"]
    # ... while the lifetime totals hold the history too
    assert stats["caches"]["kv"]["hits"] == platform.ledger.kv_hits + 5
    # and a terminal reader gets the same figures as text
    text = platform.manage("routing_stats", "--minutes", str(WINDOW_MINUTES))
    assert f"requests           {platform.ledger.requests} ({platform.statuses_text()})" in text


def scrape(base_url: str, auth: dict[str, str], *, openmetrics: bool = False) -> dict[str, Any]:
    """GET /metrics with an operator key (`auth`): /metrics is for operators."""
    accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain"
    text = httpx.get(f"{base_url}/metrics", headers={"Accept": accept, **auth}, timeout=30).text
    parse = (
        openmetrics_parser.text_string_to_metric_families if openmetrics else text_string_to_metric_families
    )
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in parse(text)
        for sample in family.samples
    }


def counters_and_histograms(samples: dict[Any, float]) -> dict[Any, float]:
    """What must agree between frontends: everything but the gauges of the moment, and the count of
    `/metrics` answers itself (each scrape the test makes adds to it, flushed on its own frontend's
    second, so two scrapes can see one scrape apart)."""
    return {
        key: value
        for key, value in samples.items()
        if key[0].endswith(("_total", "_bucket", "_count", "_sum"))
        and not key[0].startswith("mmr_worker_")
        and ("handler", "/metrics") not in key[1]
    }


def test_metrics_are_the_same_whichever_frontend_is_scraped_and_survive_its_restart(
    observed_platform: ObservedPlatform,
) -> None:
    platform = observed_platform
    # a streamed request too: its metrics are recorded where the stream ends
    for image, stream in ((1, False), (1, True)):
        assert platform.send(image, stream=stream).status_code == 200
    first = platform.base_url

    def total(samples: dict[Any, float], name: str) -> float:
        return sum(value for key, value in samples.items() if key[0] == name)

    sent, history = platform.ledger.requests, platform.ledger.history_requests
    # Requests refused at the edge (another test's wrong key) are requests, but no worker queued,
    # routed or answered them.
    routed = sent - platform.ledger.refused_at_edge

    def flushed(samples: dict[Any, float]) -> bool:
        # The frontend and each worker flush on their own second: wait for the last of them.
        return (total(samples, "mmr_requests_total"), total(samples, "mmr_queue_seconds_count")) == (
            sent + history,
            routed,
        )

    samples = eventually(lambda: scrape(first, platform.processes.headers), flushed)
    # every process recorded its part: the frontend and both workers' engines (simulated workers
    # decode no image: tests/test_image_loader.py times a worker's decodes)
    counted = (total(samples, "mmr_requests_total"), total(samples, "mmr_queue_seconds_count"))
    assert flushed(samples), f"requests and queue counts {counted}, expected {(sent + history, routed)}"
    assert total(samples, "mmr_ttft_seconds_count") == routed
    assert total(samples, "mmr_routing_decision_seconds_count") == routed
    assert total(samples, "mmr_inter_token_seconds_count") > 0
    for worker in WORKERS:
        assert ("mmr_engine_kv_blocks_free", (("worker", worker),)) in samples

    # when: a second frontend process answers the scrape, and then again after it restarts
    second = platform.processes.start_server()
    at_second = counters_and_histograms(scrape(second, platform.processes.headers, openmetrics=True))
    platform.processes.servers[-1].terminate()
    platform.processes.servers[-1].wait(timeout=30)
    restarted = platform.processes.start_server()
    after_restart = counters_and_histograms(scrape(restarted, platform.processes.headers))

    # then: the same figures (OpenMetrics names counters' samples as text does)
    at_first = counters_and_histograms(scrape(first, platform.processes.headers))
    assert at_first == at_second == after_restart
