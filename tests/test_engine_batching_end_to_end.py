"""A real `run_worker` with default settings batches concurrent requests: its heartbeat reports
them in one batch, and its counters show fewer forward passes than tokens generated. The worker
is the session's lone one (tests/conftest.py), whose counters only this module's requests move."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.conftest import LONE_WORKER

CONCURRENT = 8


def test_eight_concurrent_requests_run_in_one_batch_with_fewer_steps_than_tokens(lone_frontend):
    # given one worker with the default engine settings, which never had more than one request
    # in a batch, and a frontend
    platform = lone_frontend
    base_url = platform.base_url
    platform.wait_until_idle(LONE_WORKER)
    key = platform.heartbeat_key(LONE_WORKER)
    before = json.loads(platform.redis.get(key))
    assert before["running"] == 0 and before["kv_blocks_used"] == 0
    assert before["running_peak"] <= 1  # the flush test's one request at most: the peak is ours
    assert before["max_running"] >= CONCURRENT
    assert before["schedule_policy"] == "shortest_first"  # what the router's load bound reads

    # when eight clients ask at once
    responses: dict[int, httpx.Response] = {}

    def ask(n: int) -> None:
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": f"Tell me story number {n} about a garden."}],
            "max_tokens": 96,
            "temperature": 1.0,
            "seed": n,
        }
        responses[n] = httpx.post(
            f"{base_url}/v1/chat/completions", json=body, headers=platform.headers, timeout=120
        )

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(CONCURRENT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # then all answered, the engine had all eight in one batch, and took fewer steps than tokens
    assert all(response.status_code == 200 for response in responses.values()), [
        response.text for response in responses.values() if response.status_code != 200
    ]
    generated = sum(response.json()["usage"]["completion_tokens"] for response in responses.values())
    after = platform.redis.get(key)
    deadline = time.monotonic() + 5
    while json.loads(after)["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
        after = platform.redis.get(key)
    report = json.loads(after)
    assert report["running_peak"] == CONCURRENT
    assert report["generated_tokens"] - before["generated_tokens"] >= generated
    steps = report["forward_passes"] - before["forward_passes"]
    assert 0 < steps < generated
    assert report["running"] == report["waiting"] == report["kv_blocks_used"] == 0
