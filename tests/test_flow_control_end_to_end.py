"""The admission queue across real processes: frontends (uvicorn) of each test's own and the
session's held worker (`held_platform`: one `run_worker --engine sim`), real Redis and Celery. The
one worker is held busy deterministically, as in the saturated-worker test
(tests/test_routing_faults.py): frozen with SIGSTOP before a first request is sent, whose
reservation then keeps it busy (ROUTER_BUSY_MAX_REQUESTS=1) until the test lets it go on; what
waits meanwhile is read from Redis, never from timing between processes. The worker is shared:
each test reads what it caused (its own requests' ids, counts as they moved during the test)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import redis

from routing.admission.queue import DEPTH_KEY, DRAINED_FAMILY, ENTRY_FAMILY
from routing.kv.load import LoadTracker
from routing.observe import telemetry
from tests.conftest import HELD_WORKER
from tests.platform_harness import PlatformProcesses
from tests.test_routing_faults import text_request

HELD = HELD_WORKER


def queue_depth(platform: PlatformProcesses) -> int:
    """Requests waiting, as the queue counts them (read as it is: the test sweeps nothing)."""
    return sum(int(n) for n in platform.redis.hvals(f"{platform.namespace}{DEPTH_KEY}"))


def until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def counted(platform: PlatformProcesses) -> dict:
    """Every request status the frontends counted, by worker (for a failure's message)."""
    totals = telemetry.read_totals(platform.redis, platform.statistics_namespace)
    return dict(totals["requests"].values) if "requests" in totals else {}


def answered_without_a_worker(platform: PlatformProcesses, status: int) -> int:
    """Requests the frontends closed with `status` before any worker was chosen for them."""
    totals = telemetry.read_totals(platform.redis, platform.statistics_namespace)
    return int(telemetry.counter_sum(totals, "requests", status=str(status), worker="none"))


class Held:
    """The only worker frozen, and one request in flight there that keeps it busy."""

    def __init__(self, platform: PlatformProcesses, base_url: str) -> None:
        self.platform = platform
        platform.wait_until_idle(HELD)  # the worker is shared: no earlier request still reported
        platform.stop_worker(HELD, signal.SIGSTOP, wait=False)
        self.answers: list[httpx.Response] = []
        self.thread = post_in_background(
            base_url, text_request("Tell a story.", 8), platform.headers, self.answers
        )
        load = LoadTracker(platform.redis, platform.namespace)
        until(lambda: load.snapshot([HELD])[HELD].active_requests == 1, "the first request was never routed")

    def release(self) -> None:
        self.platform.workers[HELD].send_signal(signal.SIGCONT)

    def join(self) -> None:
        self.thread.join(timeout=120)
        assert [answer.status_code for answer in self.answers] == [200]


def post_in_background(
    base_url: str, body: dict, headers: dict[str, str], answers: list[httpx.Response | httpx.HTTPError]
) -> threading.Thread:
    """POST in a thread; the answer (or the error of a frontend that died) goes to `answers`."""

    def post() -> None:
        try:
            answers.append(
                httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
            )
        except httpx.HTTPError as error:
            answers.append(error)

    thread = threading.Thread(target=post)
    thread.start()
    return thread


def busy_platform(held_platform, frontends: int, **env: str) -> tuple[PlatformProcesses, list[str]]:
    """The held worker behind `frontends` frontends of the test's own, which count it busy with
    one request and queue what comes meanwhile."""
    platform = held_platform(ROUTER_BUSY_MAX_REQUESTS="1", ROUTER_QUEUE_ENABLED="1", **env)
    return platform, [platform.start_server() for _ in range(frontends)]


def test_requests_queued_on_two_frontends_leave_in_one_order_each_once_by_its_own_frontend(
    held_platform,
):
    # given: two frontends before one busy worker, and two tenants of equal weight
    platform, (first, second) = busy_platform(held_platform, frontends=2)
    heavy, light = platform.make_keys({"tenant": "heavy"}, {"tenant": "light"})
    held = Held(platform, second)
    drained_key = f"{platform.namespace}{DRAINED_FAMILY}demo"
    left: dict[bytes, float] = {}  # every dispatch the queue records, as it records it
    watching = threading.Event()

    def watch() -> None:
        # read once more after the answers are in: the last dispatch may come and be answered
        # between two reads (the held worker runs faster than real time)
        watcher = redis.Redis.from_url(platform.env["REDIS_URL"])
        while True:
            answered = watching.is_set()
            left.update(watcher.zrange(drained_key, 0, -1, withscores=True))
            if answered:
                break
            time.sleep(0.02)

    # when: the heavy tenant queues three requests across both frontends, then the light one one
    answers: dict[str, list[httpx.Response]] = {}
    threads = []
    arrivals = [("h0", first, heavy), ("h1", second, heavy), ("h2", first, heavy), ("l0", second, light)]
    for n, (name, base_url, key) in enumerate(arrivals, start=1):
        answers[name] = []
        body = text_request(f"Request {name}.", 2)
        threads.append(post_in_background(base_url, body, {"Authorization": f"Bearer {key}"}, answers[name]))
        until(lambda n=n: queue_depth(platform) == n, f"{name} never queued")
    watcher = threading.Thread(target=watch)
    watcher.start()
    held.release()
    for thread in threads:
        thread.join(timeout=180)
    watching.set()
    watcher.join()
    held.join()

    # then: every request answered once, and they left in the shared fair order (the light
    # tenant's first request second, not behind the heavy tenant's backlog)
    ids = {name: responses[0].headers["X-Request-Id"] for name, responses in answers.items()}
    assert all([r.status_code for r in responses] == [200] for responses in answers.values()), answers
    mine = set(ids.values())  # the worker is shared: earlier tests' dispatches are recorded too
    order = [
        request_id
        for member, _ in sorted(left.items(), key=lambda m: (m[1], m[0]))
        if (request_id := member.decode().split(":", 1)[1]) in mine
    ]
    assert order == [ids["h0"], ids["l0"], ids["h1"], ids["h2"]]
    # each by the frontend its client called: that process's log says it sent it, the other's not
    logs = {first: platform.log("server"), second: platform.log("server-1")}
    for name, base_url, _ in arrivals:
        other = second if base_url == first else first
        assert f"request {ids[name]} " in logs[base_url] and f"request {ids[name]} " not in logs[other]
    assert queue_depth(platform) == 0


def test_a_client_gone_while_queued_never_reaches_a_worker_and_shed_requests_get_openai_errors(
    held_platform,
):
    # given: a busy worker, a tenant that may queue one request, and a wait of a few seconds
    platform, (base_url,) = busy_platform(
        held_platform, frontends=1, ROUTER_QUEUE_MAX_TENANT_DEPTH="1", ROUTER_QUEUE_MAX_WAIT_SECS="3"
    )
    (tenant_key,) = platform.make_keys({"tenant": "queued-tenant"})
    statuses = (499, 429, 503)
    closed = lambda: [answered_without_a_worker(platform, status) for status in statuses]  # noqa: E731
    # the counts so far (earlier tests' frontends, stopped before this test, flushed theirs)
    closed_before = closed()
    tenant = {"Authorization": f"Bearer {tenant_key}"}
    held = Held(platform, base_url)

    # when: a client queues a request and hangs up while it waits
    address = urlsplit(base_url)
    body = json.dumps(text_request("I will not wait.", 2)).encode()
    client = socket.create_connection((address.hostname, address.port))
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {tenant_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    until(lambda: queue_depth(platform) == 1, "the request never queued")
    client.close()

    # then: it leaves the queue at once (the frontend saw the disconnect)
    until(lambda: queue_depth(platform) == 0, "the abandoned request stayed in the queue")

    # when: the tenant queues one request, and another past its own depth
    waiting: list[httpx.Response] = []
    thread = post_in_background(base_url, text_request("I will wait.", 2), tenant, waiting)
    until(lambda: queue_depth(platform) == 1, "the tenant's request never queued")
    refused = httpx.post(f"{base_url}/v1/chat/completions", json=text_request("Me too.", 2), headers=tenant)
    thread.join(timeout=60)

    # then: the second is refused as the tenant's own share (429), the first after its wait
    # (503), both in OpenAI's error format with when to retry; neither reached the worker
    assert refused.status_code == 429, refused.text
    assert waiting[0].status_code == 503, waiting[0].text
    for response, code, kind in (
        (refused, "tenant_queue_full", "rate_limit_error"),
        (waiting[0], "queue_timeout", "server_error"),
    ):
        error = response.json()["error"]
        assert (error["code"], error["type"]) == (code, kind) and error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        assert int(response.headers["Retry-After"]) >= 1
    assert queue_depth(platform) == 0
    held.release()
    held.join()
    # and each of the three was closed with no worker ever chosen for it (the frontend counts
    # them as it closes them; its counts reach Redis at its next flush)
    closed_now = lambda: [now - before for now, before in zip(closed(), closed_before, strict=True)]  # noqa: E731
    try:
        until(lambda: closed_now() == [1, 1, 1], "the three requests counted as closed without a worker")
    except AssertionError:
        raise AssertionError(f"counted: {counted(platform)}") from None


def test_a_killed_frontend_leaves_no_request_in_the_queue_past_its_liveness_ttl(held_platform):
    # given: two frontends with requests waiting for a busy worker, two on the first
    platform, (doomed, survivor) = busy_platform(
        held_platform, frontends=2, ROUTER_QUEUE_FRONTEND_TTL_SECS="2"
    )
    held = Held(platform, survivor)
    answers: list[httpx.Response] = []
    threads = []
    for n, base_url in enumerate((doomed, doomed, survivor), start=1):
        threads.append(
            post_in_background(base_url, text_request(f"Waiting {n}.", 2), platform.headers, answers)
        )
        until(lambda n=n: queue_depth(platform) == n, f"request {n} never queued")

    # when: the first frontend is killed
    platform.servers[0].send_signal(signal.SIGKILL)
    platform.servers[0].wait(timeout=30)
    killed_at = time.monotonic()

    # then: its requests leave the queue within its liveness TTL (and the next poll of the other
    # frontend's request), the other frontend's stays, and is served once the worker frees
    until(lambda: queue_depth(platform) == 1, "the killed frontend's requests stayed", timeout_s=10)
    assert time.monotonic() - killed_at <= 2 + 1.5
    assert len(list(platform.redis.scan_iter(match=f"{platform.namespace}{ENTRY_FAMILY}*"))) == 1
    held.release()
    for thread in threads:
        thread.join(timeout=120)
    held.join()
    served = [answer for answer in answers if isinstance(answer, httpx.Response)]
    assert [answer.status_code for answer in served] == [200]
