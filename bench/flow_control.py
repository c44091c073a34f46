"""The admission queue under overload, through the real platform (uvicorn frontend → Celery → two
run_worker processes on the demo model), each comparison's two arms in the same run.

Usage: `.venv/bin/python bench/flow_control.py [--scale 1.0] [--max-tokens 64]` (Redis at
REDIS_URL, default redis://127.0.0.1:6379/14, under a namespace of its own deleted afterwards).
`--scale` shortens every phase (0.1 for a smoke run; the issue's figures need 1.0). The last
line is:
    burst_refused=<n> fair_ttft_p90_ratio=<x.xx> priority_ttft_p90_ratio=<x.xx>

What it does, and why:
- Capacity first: a closed loop keeps every worker's engine full (ROUTER_BUSY_MAX_REQUESTS in
  flight per worker) for a while; capacity is the answers per second it got. Every rate below is
  a multiple of it, and a tenant's queue depth is what drains in the maximum wait (30 s): a
  deeper queue would only hold requests bound to time out (all tenants together: twice that).
- Burst: 3x capacity offered for 10 s (a backlog of ~20 s), with the queue, then with it off
  (`ROUTER_QUEUE_ENABLED=0`, the 503 at once). Printed: requests refused in each arm; with the
  queue every one should be answered, and the queue drains.
- Fairness: tenant H offers 10x capacity, tenant L 20% of it (at least 200 requests of L), with
  fair queuing, then with one arrival-order queue (`ROUTER_QUEUE_ORDER=fifo`). Printed: L's TTFT
  p90 in each, their ratio (fair / FIFO), and the share of L's requests answered.
- Priority: one tenant floods at 3x capacity at priority 0 while its other requests ask for
  priority 9 at 20% of capacity (at least 200), with priorities, then with them ignored
  (`REQUEST_PRIORITIES=0`: one band, arrival order, and no priority in the engines). Printed:
  the high-priority requests' TTFT p90 in each and their ratio (priority / FIFO).
- Answers are `--max-tokens` long (64 by default, a short chat answer). Every rate is a multiple
  of capacity, so the answer's length sets how many requests a second the one frontend must take
  in: with 4-token answers the demo model answers ~40 a second and the fairness flood is ~400 a
  second, on the same two cores as both engines; what that measures is the frontend's HTTP
  throughput, not the order it serves requests in.
- TTFT is what a client sees of a streamed answer: from sending to its status line, which waits
  for the first token. Requests are open-loop (sent on a clock, whatever came back). Each flood
  is sent from a process of its own, so that its client work does not delay the requests
  measured.
On a shared machine the milliseconds are noisy: compare the ratios, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.samples import demo_model_dir, quantile  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402

WORKERS = ("flow_a", "flow_b")
IN_FLIGHT_PER_WORKER = 20  # ENGINE_MAX_RUNNING + ENGINE_WAITING_SLOTS: the busy threshold
MAX_WAIT_S = 30.0


@dataclass(frozen=True)
class Answer:
    status: int
    ttft_s: float | None  # None: refused, or no answer
    sent_s: float = 0.0  # when it was sent, from the start of its offer


def body(n: int, priority: int | None = None, *, max_tokens: int) -> dict:
    request = {
        "model": "demo",
        "messages": [{"role": "user", "content": f"Question {n}: describe a red bicycle in a few words."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if priority is not None:
        request["priority"] = priority
    return request


async def ask(client: httpx.AsyncClient, url: str, key: str, request: dict, since: float = 0.0) -> Answer:
    sent = time.perf_counter()
    answer = await _ask(client, url, key, request, sent)
    return dataclasses.replace(answer, sent_s=sent - since) if since else answer


async def _ask(client: httpx.AsyncClient, url: str, key: str, request: dict, sent: float) -> Answer:
    try:
        async with client.stream(
            "POST", url, json=request, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            ttft = time.perf_counter() - sent
            async for _ in response.aiter_bytes():
                pass
            return Answer(response.status_code, ttft if response.status_code == 200 else None)
    except httpx.HTTPError:
        return Answer(0, None)


async def offer(
    client: httpx.AsyncClient, url: str, key: str, rate: float, duration_s: float, make: Callable[[int], dict]
) -> list[Answer]:
    """Requests sent at `rate` per second for `duration_s`, on a clock; every answer, in order."""
    started = time.perf_counter()
    tasks = []
    for n in range(max(1, round(rate * duration_s))):
        delay = started + n / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(ask(client, url, key, make(n), since=started)))
    return list(await asyncio.gather(*tasks))


def sent_per_s(answers: list[Answer]) -> float:
    """The rate the requests really left at (a client that falls behind sends fewer than offered)."""
    last = max((a.sent_s for a in answers), default=0.0)
    return (len(answers) - 1) / last if last > 0 else math.inf


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=MAX_WAIT_S * 4, limits=httpx.Limits(max_connections=None, max_keepalive_connections=200)
    )


async def flood(
    url: str, key: str, rate: float, duration_s: float, make: Callable[[int], dict]
) -> list[Answer]:
    """`offer`, from a process of its own (forked): a flood's own client work (hundreds of
    requests a second) then delays neither the sending nor the timing of the requests measured."""
    receiving, sending = multiprocessing.Pipe(duplex=False)

    def offered() -> None:
        async def run() -> list[Answer]:
            async with new_client() as client:
                return await offer(client, url, key, rate, duration_s, make)

        sending.send(asyncio.run(run()))

    process = multiprocessing.get_context("fork").Process(target=offered, daemon=True)
    process.start()
    answers = await asyncio.to_thread(receiving.recv)
    await asyncio.to_thread(process.join)
    return answers


async def closed_loop(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    clients: int,
    duration_s: float,
    make: Callable[[int], dict],
) -> float:
    """Answers per second with `clients` requests always in flight."""
    done = 0
    deadline = time.perf_counter() + duration_s

    async def loop(c: int) -> None:
        nonlocal done
        n = 0
        while time.perf_counter() < deadline:
            if (await ask(client, url, key, make(c * 100_000 + n))).status == 200:
                done += 1
            n += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in range(clients)))
    return done / (time.perf_counter() - started)


def p90(answers: list[Answer]) -> float:
    ttfts = [a.ttft_s for a in answers if a.ttft_s is not None]
    return quantile(ttfts, 0.9) if ttfts else math.inf


def refused(answers: list[Answer]) -> int:
    return sum(a.status != 200 for a in answers)


class Bench:
    def __init__(
        self, platform: PlatformProcesses, keys: dict[str, str], scale: float, max_tokens: int
    ) -> None:
        self.platform = platform
        self.keys = keys
        self.scale = scale
        self.max_tokens = max_tokens
        self.client = new_client()

    def body(self, n: int, priority: int | None = None) -> dict:
        return body(n, priority, max_tokens=self.max_tokens)

    def frontend(self, **env: str) -> str:
        """A fresh frontend with this arm's settings (the last one stopped): its chat URL."""
        for server in self.platform.servers:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=60)
        return self.platform.start_server(**env) + "/v1/chat/completions"

    async def settle(self) -> None:
        """Until nothing waits in the queue or runs on a worker (the arms do not overlap)."""
        from routing.kv.load import LoadTracker

        load = LoadTracker(self.platform.redis, self.platform.namespace)
        deadline = time.monotonic() + 120
        while any(w.active_requests for w in load.snapshot(list(WORKERS)).values()):
            assert time.monotonic() < deadline, "the workers never went idle"
            await asyncio.sleep(0.2)

    async def capacity(self) -> float:
        url = self.frontend()
        clients = IN_FLIGHT_PER_WORKER * len(WORKERS)
        key = self.keys["burst"]
        await closed_loop(self.client, url, key, clients, max(5.0, 5 * self.scale), self.body)  # warm up
        rate = await closed_loop(self.client, url, key, clients, max(8.0, 20 * self.scale), self.body)
        await self.settle()
        return rate

    def bounds(self, capacity: float) -> dict[str, str]:
        """A tenant may queue what drains in the maximum wait; all of them, twice that."""
        depth = max(1, math.ceil(capacity * MAX_WAIT_S))
        return {
            "ROUTER_QUEUE_MAX_WAIT_SECS": str(MAX_WAIT_S),
            "ROUTER_QUEUE_MAX_DEPTH": str(2 * depth),
            "ROUTER_QUEUE_MAX_TENANT_DEPTH": str(depth),
        }

    async def burst(self, capacity: float, **env: str) -> list[Answer]:
        url = self.frontend(**env)
        answers = await offer(
            self.client, url, self.keys["burst"], 3 * capacity, max(2.0, 10 * self.scale), self.body
        )
        await self.settle()
        return answers

    async def fairness(self, capacity: float, **env: str) -> tuple[list[Answer], list[Answer]]:
        url = self.frontend(**env)
        light_rate = 0.2 * capacity
        duration = max(10.0, 200 / light_rate) * self.scale
        heavy, light = await asyncio.gather(
            flood(url, self.keys["heavy"], 10 * capacity, duration, self.body),
            offer(self.client, url, self.keys["light"], light_rate, duration, lambda n: self.body(10**6 + n)),
        )
        await self.settle()
        return heavy, light

    async def priority(self, capacity: float, **env: str) -> list[Answer]:
        url = self.frontend(**env)
        high_rate = 0.2 * capacity
        duration = max(10.0, 200 / high_rate) * self.scale
        _, high = await asyncio.gather(
            flood(url, self.keys["mixed"], 3 * capacity, duration, lambda n: self.body(n, 0)),
            offer(
                self.client, url, self.keys["mixed"], high_rate, duration, lambda n: self.body(10**6 + n, 9)
            ),
        )
        await self.settle()
        return high


async def run(bench: Bench) -> str:
    capacity = await bench.capacity()
    print(
        f"capacity: {capacity:.2f} answers/s of {bench.max_tokens} tokens with {len(WORKERS)} workers full",
        flush=True,
    )
    bounds = bench.bounds(capacity)

    queued = await bench.burst(capacity, **bounds)
    unqueued = await bench.burst(capacity, ROUTER_QUEUE_ENABLED="0", **bounds)
    print(
        f"burst: {len(queued)} requests at 3x capacity: refused {refused(queued)} with the queue, "
        f"{refused(unqueued)} without it; TTFT p90 with the queue {p90(queued):.2f} s",
        flush=True,
    )

    fair_heavy, fair_light = await bench.fairness(capacity, ROUTER_QUEUE_ORDER="fair", **bounds)
    fifo_heavy, fifo_light = await bench.fairness(capacity, ROUTER_QUEUE_ORDER="fifo", **bounds)
    print(
        f"fairness: H offered {10 * capacity:.0f}/s, sent {sent_per_s(fair_heavy):.0f}/s fair, "
        f"{sent_per_s(fifo_heavy):.0f}/s FIFO (below {capacity:.0f}/s nothing needs to wait)",
        flush=True,
    )
    fair_ratio = p90(fair_light) / p90(fifo_light)
    print(
        f"fairness: L sent {len(fair_light)}; answered {len(fair_light) - refused(fair_light)} fair, "
        f"{len(fifo_light) - refused(fifo_light)} FIFO; L's TTFT p90 {p90(fair_light):.2f} s fair, "
        f"{p90(fifo_light):.2f} s FIFO",
        flush=True,
    )

    by_priority = await bench.priority(capacity, **bounds)
    ignored = await bench.priority(capacity, REQUEST_PRIORITIES="0", ROUTER_QUEUE_ORDER="fifo", **bounds)
    priority_ratio = p90(by_priority) / p90(ignored)
    print(
        f"priority: {len(by_priority)} high-priority requests; TTFT p90 {p90(by_priority):.2f} s with "
        f"priorities, {p90(ignored):.2f} s ignored (answered {len(by_priority) - refused(by_priority)}, "
        f"{len(ignored) - refused(ignored)})",
        flush=True,
    )
    await bench.client.aclose()
    return (
        f"burst_refused={refused(queued)} fair_ttft_p90_ratio={fair_ratio:.2f} "
        f"priority_ttft_p90_ratio={priority_ratio:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="shortens every phase (1.0: the issue's)")
    parser.add_argument("--max-tokens", type=int, default=64, help="each answer's length (see the module)")
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    model = demo_model_dir()
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as scratch:
        platform = PlatformProcesses(
            Path(scratch),
            model,
            redis_url,
            f"bench-flow:{uuid.uuid4().hex[:8]}:",
            {"MODEL_NAME": "demo", "LOG_LEVEL": "WARNING"},
        )
        try:
            heavy, light, burst, mixed = platform.make_keys(
                {"tenant": "heavy"},
                {"tenant": "light"},
                {"tenant": "burst"},
                {"tenant": "mixed", "default_priority": 0, "max_priority": 9},
            )
            for name in WORKERS:
                platform.start_worker(name)
            platform.wait_for_workers(*WORKERS)
            keys = {"heavy": heavy, "light": light, "burst": burst, "mixed": mixed}
            last_line = asyncio.run(run(Bench(platform, keys, args.scale, args.max_tokens)))
        finally:
            platform.close()
    print(last_line)


if __name__ == "__main__":
    main()
