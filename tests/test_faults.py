"""Faults injected into the real platform (worker and server processes, Redis): what the client
gets, that nothing hangs past its deadline, and that load counters come back to zero.

Two platforms serve the tests: the module's, with two simulated workers and two frontends (a
worker killed, then a frontend killed: each test leaves the part it did not kill serving, but the
last, which kills the worker that is left), and
the session's on a Redis of its own (`private_redis_platform`, which tests/test_routing_faults.py
shares: Redis killed and restarted mid-load, restarted while idle, frozen; each test ends with the
platform serving again).
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import subprocess
import threading
import time
import uuid

import httpx
import pytest

from routing.kv.index import KvIndex
from routing.kv.load import LoadTracker
from routing.observe.telemetry import FLUSH_INTERVAL_SECS
from tests.platform_harness import SIMULATED, run_worker_args


def chat(
    platform, text: str, *, max_tokens: int = 4, stream: bool = False, base_url: str = ""
) -> httpx.Response:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    return httpx.post(
        f"{base_url or platform.base_url}/v1/chat/completions",
        json=body,
        headers=platform.headers,
        timeout=90,
    )


def set_enabled(platform, worker: str, enabled: bool) -> None:
    """What an operator's click in the admin does: the row every frontend reads, then a new
    generation in the platform's Redis, which makes them read it again (routing.fleet.worker_rows)."""
    from routing.fleet.worker_rows import announce_change

    with sqlite3.connect(platform.database, timeout=20) as db:
        db.execute("UPDATE routing_worker SET enabled = ? WHERE name = ?", (int(enabled), worker))
    announce_change(platform.redis, platform.namespace)


def active_requests(platform) -> dict[bytes, bytes]:
    return platform.redis.hgetall(f"{platform.namespace}load:totals")


def own_platform(platform_harness, tmp_path_factory, demo_model_dir, redis_url: str, **env: str):
    return platform_harness(
        tmp_path_factory.mktemp("faults"), demo_model_dir, redis_url, f"test:{uuid.uuid4().hex[:12]}:", env
    )


@pytest.fixture(scope="module")
def two_workers(platform_harness, tmp_path_factory, demo_model_dir):
    """Workers doomed and spare, two frontends; liveness marks of 2 s."""
    from tests.conftest import TEST_REDIS_URL

    platform = own_platform(
        platform_harness,
        tmp_path_factory,
        demo_model_dir,
        TEST_REDIS_URL,
        REQUEST_FIRST_TOKEN_TIMEOUT_SECS="60",
        REQUEST_LIVENESS_TTL_SECS="2",
        ROUTER_LOAD_ENTRY_TTL_SECS="300",
    )
    try:
        platform.start_worker("doomed", *SIMULATED)
        platform.start_worker("spare", *SIMULATED)
        platform.wait_for_workers("doomed", "spare")
        platform.start_server()
        platform.start_server()
        yield platform
    finally:
        platform.close()


def test_requests_on_a_worker_killed_before_their_first_token_are_answered_by_another(two_workers):
    # given two workers, the requests going to "doomed" while "spare" is disabled
    platform = two_workers
    set_enabled(platform, "spare", False)
    assert chat(platform, "warm up").headers["X-Routed-Worker"] == "doomed"

    # when doomed freezes with four requests queued, and is then killed (mid-load, no token out)
    platform.stop_worker("doomed", signal.SIGSTOP, wait=False)
    answers: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        answers[i] = chat(platform, f"Question number {i} about rivers", stream=i % 2 == 1)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    # all four routed to doomed (its reservations say so) while its heartbeat is still fresh: a
    # wait for that state, not for a time that a loaded machine may overrun
    load = LoadTracker(platform.redis, platform.namespace)
    deadline = time.monotonic() + 30
    while load.snapshot(["doomed"])["doomed"].active_requests < 4:
        assert time.monotonic() < deadline, "the requests never all reached doomed"
        time.sleep(0.05)
    set_enabled(platform, "spare", True)
    platform.stop_worker("doomed", signal.SIGKILL)
    started = time.monotonic()
    for thread in threads:
        thread.join(timeout=60)

    # then every request was answered 200 by spare, transparently, streams included
    assert time.monotonic() - started < 30
    assert sorted(answers) == [0, 1, 2, 3]
    for i, response in answers.items():
        assert response.status_code == 200, response.text
        assert response.headers.get("X-Request-Id")
        # streams too: their status line waits for the first token, which spare sent
        assert response.headers["X-Routed-Worker"] == "spare"
        if i % 2 == 0:
            assert response.json()["usage"]["completion_tokens"] > 0
        else:
            assert '"error"' not in response.text and response.text.endswith("data: [DONE]\n\n")
            assert '"content"' in response.text
    # and the load of every request came back to zero on both workers
    deadline = time.monotonic() + 5
    while active_requests(platform) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert active_requests(platform) == {}
    assert "migrated to spare" in platform.log("server")


def test_a_frontend_killed_mid_load_leaves_no_phantom_load_and_the_worker_stops_generating(two_workers):
    # given workers generating long answers for the second frontend, whose marks live 2 s
    platform = two_workers
    frontend, frontend_url = platform.servers[1], platform.server_urls[1]

    def ask_forever(i: int) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the frontend dies under it: that is the point
            chat(platform, f"Tell me a long story {i}", max_tokens=2000, stream=True, base_url=frontend_url)

    threads = [threading.Thread(target=ask_forever, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    # Reached the worker: it started them (load is reserved earlier, at the routing decision).
    while len(list(platform.redis.scan_iter(match=f"{platform.namespace}resp:*"))) < 3:
        assert time.monotonic() < deadline, "the requests never reached the worker"
        time.sleep(0.1)

    # when the frontend is killed outright (no cleanup of its own)
    frontend.send_signal(signal.SIGKILL)
    frontend.wait(timeout=10)
    killed = time.monotonic()

    # then within the mark's TTL (and far within the 300 s load expiry) the load is gone
    while active_requests(platform) and time.monotonic() - killed < 15:
        time.sleep(0.2)
    assert active_requests(platform) == {}, "phantom load left by a dead frontend"
    assert time.monotonic() - killed < 15
    # and the worker stopped the answers nobody reads, rather than generating them to the end
    logs = platform.log("worker-doomed") + platform.log("worker-spare")
    assert logs.count("its frontend went away") == 3, logs[-2000:]


# --- Redis killed, restarted, frozen -------------------------------------------------------------
# The session's platform on a Redis of its own (tests/conftest.py `private_redis_platform`): two
# simulated workers in one process and a frontend, every Redis wait bounded by 2 s.
@pytest.fixture
def private_redis(private_redis_platform):
    return private_redis_platform.server


@pytest.fixture
def redis_platform(private_redis_platform):
    return private_redis_platform.platform


def beating_again(platform) -> bool:
    """Every worker of the platform has beaten since Redis came back."""
    return all(platform.redis.exists(platform.heartbeat_key(name)) for name in platform.simulated_workers)


def test_redis_killed_and_restarted_mid_load_answers_every_request_and_recovers(
    private_redis, redis_platform
):
    # given a platform whose only Redis the test owns
    platform = redis_platform
    assert chat(platform, "warm up").status_code == 200

    # when Redis is killed with requests in flight, then restarted (empty) a second later
    answers: list[httpx.Response | Exception] = []

    def ask(i: int) -> None:
        try:
            answers.append(chat(platform, f"Question {i}", max_tokens=40))
        except httpx.HTTPError as exc:
            answers.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    private_redis.kill()
    time.sleep(1.0)
    private_redis.start()
    started = time.monotonic()
    for thread in threads:
        thread.join(timeout=60)

    # then every request got an answer (200, or a 503 saying the shared state was lost), in time
    assert len(answers) == 4
    assert time.monotonic() - started < 45
    for answer in answers:
        assert isinstance(answer, httpx.Response), answer
        assert answer.status_code in (200, 503), answer.text
        if answer.status_code == 503:
            assert answer.json()["error"]["code"] in (
                "state_unavailable",
                "broker_unavailable",  # Redis is the broker too: a send while it is down
                "worker_vanished",
                "no_live_worker",
            )
    # and once the worker beats again, requests are served again (that none then fails on a stale
    # pooled connection is the next test's: this loop would absorb such failures)
    deadline = time.monotonic() + 15
    while not beating_again(platform):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # the workers' Celery consumer reconnects to the restarted broker on its own schedule
    while chat(platform, "Anyone back?").status_code != 200:
        assert time.monotonic() < deadline + 20, platform.log_tail("worker-sturdy")
        time.sleep(0.5)
    after = [chat(platform, f"After the restart {i}") for i in range(4)]
    assert [response.status_code for response in after] == [200] * 4, [r.text for r in after]
    assert active_requests(platform) == {}


def generations_run(platform) -> int:
    """Requests the workers ran to the end since Redis last started empty: each worker's KV cache
    counts one hit or one miss per finished generation (flushed to Redis about once a second)."""
    run = 0
    for worker in platform.simulated_workers:
        totals = platform.redis.hgetall(f"{platform.statistics_namespace}stats:{worker}:kv")
        run += int(totals.get(b"hits", 0)) + int(totals.get(b"misses", 0))
    return run


def settled_runs(platform) -> int:
    """`generations_run` once nothing more can come: every worker idle (an earlier test's late
    runs, a restored task, finished) and the count unchanged over a few of the workers' flushes
    (their counts reach Redis about once a second, so a run that just ended may not show yet)."""
    for name in platform.simulated_workers:
        platform.wait_until_idle(name)
    deadline = time.monotonic() + 20
    seen, since = generations_run(platform), time.monotonic()
    while time.monotonic() - since < 2.5 * FLUSH_INTERVAL_SECS:
        assert time.monotonic() < deadline, f"the workers' run count never settled (last {seen})"
        time.sleep(0.2)
        now = generations_run(platform)
        if now != seen:
            seen, since = now, time.monotonic()
    return seen


def ask_all(platform, count: int, text: str) -> list[httpx.Response | Exception]:
    """`count` requests at once, each on a connection of its own (the frontend's pools grow)."""
    answers: list[httpx.Response | Exception] = [RuntimeError("no answer")] * count

    def ask(i: int) -> None:
        try:
            answers[i] = chat(platform, f"{text} {i}", max_tokens=2)
        except httpx.HTTPError as exc:
            answers[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    return answers


def test_redis_restarted_while_idle_every_request_after_it_is_answered_and_runs_once(
    private_redis, redis_platform
):
    # given a frontend whose asyncio pool holds many connections: concurrent requests opened them
    platform = redis_platform
    # (counted once the module's earlier tests are done with: the one before kills Redis under
    # load, and a task it had queued may still run and be counted here)
    counted = settled_runs(platform)
    warm = ask_all(platform, 12, "Warm up question")
    assert [getattr(answer, "status_code", answer) for answer in warm] == [200] * 12
    # every count of the warm-up reached Redis: none is left to be written after the restart
    assert settled_runs(platform) == counted + 12

    # when Redis is killed and started again, empty, while the platform is idle: every pooled
    # connection of the frontend now points at a socket the server closed
    private_redis.kill()
    private_redis.start()
    deadline = time.monotonic() + 15
    while not beating_again(platform):
        assert time.monotonic() < deadline, platform.log_tail("worker-sturdy")
        time.sleep(0.1)
    assert generations_run(platform) == 0  # the counters start again from zero too

    # then the first requests sent afterwards, at once, are each answered 200 (none meets a stale
    # connection and fails after its task was queued) ...
    answers = ask_all(platform, 12, "After the restart")
    statuses = [getattr(answer, "status_code", repr(answer)) for answer in answers]
    answered = statuses.count(200)
    deadline = time.monotonic() + 10
    while generations_run(platform) < answered and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # the worker's counters are flushed about once a second: late runs show here
    ran = generations_run(platform)
    failed = [answer.text[:300] for answer in answers if getattr(answer, "status_code", 0) != 200]
    redis_errors = [line for line in platform.log("server").splitlines() if "Redis failed" in line]
    assert statuses == [200] * 12, (
        f"{answered} of 12 answered 200, the worker ran {ran}: {failed}; the server: {redis_errors[-3:]}"
    )
    # ... and the worker ran exactly the requests that were answered: no work for a lost answer
    server_log = platform.log("server").splitlines()
    assert ran == answered == 12, (
        f"the worker ran {ran} generations for {answered} answers; the frontend moved requests: "
        f"{[line[-160:] for line in server_log if 'migrated to' in line or 'went away' in line][-4:]}; "
        f"tasks the worker received: {platform.log('worker-sturdy').count('] received')}"
    )
    assert active_requests(platform) == {}


def test_a_frozen_redis_answers_503_within_its_deadline_and_recovers_when_thawed(
    private_redis, redis_platform
):
    # given a platform whose Redis waits are bounded by 2 s
    platform = redis_platform
    assert chat(platform, "warm up").status_code == 200

    # when Redis freezes (SIGSTOP: connections accepted, nothing answered)
    private_redis.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        frozen = chat(platform, "Is anyone there?")
        waited = time.monotonic() - started
    finally:
        private_redis.process.send_signal(signal.SIGCONT)

    # then the client got a 503 in the API's format within the deadline (not twice it, not 20 s)
    assert frozen.status_code == 503, frozen.text
    assert frozen.json()["error"]["code"] in ("state_unavailable", "broker_unavailable")
    assert waited < 2.0 * 1.75, f"waited {waited:.1f} s on a frozen Redis"
    # and once thawed, the platform serves again
    deadline = time.monotonic() + 15
    while chat(platform, "And now?").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)


# --- a second process under a running worker's name ----------------------------------------------
def test_a_second_process_under_a_running_workers_name_never_deregisters_the_first(two_workers):
    # given spare serving, with blocks in the router's index
    import json

    from tests.platform_harness import REPO

    platform = two_workers
    set_enabled(platform, "doomed", False)
    set_enabled(platform, "spare", True)
    answer = chat(platform, "Remember this prompt about lighthouses and the sea", max_tokens=2)
    assert answer.headers["X-Routed-Worker"] == "spare"
    index = KvIndex(platform.redis, platform.namespace)
    held = index.worker_blocks("spare")
    assert held
    first_pid = platform.workers["spare"].pid

    # when someone starts `run_worker --name spare` again (the native engine's command: the rule
    # holds whatever engine serves the name, and is checked before any model loads)
    impostor = subprocess.run(
        run_worker_args("spare"),
        cwd=REPO,
        env=platform.env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    # then it refuses to start, naming the live process
    assert impostor.returncode != 0, impostor.stdout[-2000:]
    assert "already running" in impostor.stderr and f"pid {first_pid}" in impostor.stderr, impostor.stderr
    # and the first is still registered, live, and its blocks are still in the index
    with sqlite3.connect(platform.database, timeout=20) as db:
        (deregistered,) = db.execute(
            "SELECT deregistered_at FROM routing_worker WHERE name = 'spare'"
        ).fetchone()
    assert deregistered is None
    assert index.worker_blocks("spare") == held
    time.sleep(0.5)
    beat = platform.redis.get(platform.heartbeat_key("spare"))
    assert beat and json.loads(beat)["pid"] == first_pid


# --- the last worker killed -----------------------------------------------------------------------
# Last in the module: it kills spare, which the tests above need (doomed, if a test above has not
# killed it yet, goes first).
def test_the_last_worker_killed_mid_request_is_a_502_naming_the_request_and_leaves_the_live_set_in_its_ttl(
    two_workers,
):
    # given spare, the platform's only worker now, whose KV events put a prompt's blocks in the index
    platform = two_workers
    if platform.workers["doomed"].poll() is None:
        platform.stop_worker("doomed", signal.SIGKILL)
    set_enabled(platform, "spare", True)
    while platform.redis.exists(platform.heartbeat_key("doomed")):  # its 2 s TTL lapses
        time.sleep(0.1)
    assert chat(platform, "Hello").headers["X-Routed-Worker"] == "spare"
    index = KvIndex(platform.redis, platform.namespace)
    assert index.worker_blocks("spare"), "the worker's KV events reached the index"

    # when it is SIGKILLed once it has started streaming tokens for a long request
    streams_before = set(platform.redis.scan_iter(match=f"{platform.namespace}resp:*"))
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("r", chat(platform, "Write a very long story.", max_tokens=2000))
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not set(platform.redis.scan_iter(match=f"{platform.namespace}resp:*")) - streams_before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    platform.stop_worker("spare", signal.SIGKILL)
    killed_at = time.monotonic()

    # then the request is a 502 that names it (no worker is left to continue it)
    thread.join(timeout=30)
    response = result["r"]
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "worker_vanished"
    assert response.headers["X-Request-Id"] in error["message"]
    # and the worker leaves the live set when its heartbeat lapses (a 2 s TTL)
    while platform.redis.exists(platform.heartbeat_key("spare")):
        assert time.monotonic() - killed_at < 2 + 1.5, "heartbeat outlived its 2 s TTL"
        time.sleep(0.1)
    time.sleep(2.0)  # the frontend sweeps lapsed workers at most every 2 s
    response = chat(platform, "Anyone there?")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_live_worker"
    # What it had cached left the index with it: nobody will be routed there for its blocks.
    assert index.worker_blocks("spare") == set()
