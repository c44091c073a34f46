"""One real platform shared by the observability tests (window figures, dashboard, browser).

Started once per session: two simulated workers in one `run_worker --engine sim` process (what
these tests read is what the platform counts and shows, which a simulated worker reports as a
model's does: its cached tokens from a real prefix pool, its queue, KV use and latencies), one
uvicorn frontend, an image origin and an admin login. Every request the tests send goes through
`send`, which keeps a ledger of what was sent and answered, so a test can compare what the
dashboard shows with what it sent.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field

import httpx
from PIL import Image

from tests.image_server import ImageServer
from tests.platform_harness import PlatformProcesses

ADMIN_USER = "observer"
ADMIN_PASSWORD = "observer-pw-5d1e"  # a throwaway login in the test's own SQLite file
WORKER_PROCESS = "obs"
WORKERS = ("obs-0", "obs-1")  # its workers


def picture(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    image = Image.effect_noise(size, 40 + seed).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass
class Ledger:
    """What the tests sent and what the platform answered."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    kv_hits: int = 0  # requests whose prompt found a cached prefix (the worker counts these)
    statuses: dict[int, int] = field(default_factory=dict)
    history_requests: int = 0  # requests a test recorded as answered long ago (never sent now)
    refused_at_edge: int = 0  # requests refused before routing (a wrong key): never reach a worker
    answered_at: list[float] = field(default_factory=list)  # when each request was answered

    def requests_since(self, unix: float) -> int:
        return sum(1 for at in self.answered_at if at >= unix)


class ObservedPlatform:
    def __init__(self, processes: PlatformProcesses, base_url: str, origin: ImageServer) -> None:
        self.processes = processes
        self.base_url = base_url
        self.origin = origin
        self.ledger = Ledger()
        self.images = [origin.add(f"/pic-{i}.png", picture(i)) for i in range(2)]

    def send(
        self, image: int, question: str = "Describe this image.", *, stream: bool = False
    ) -> httpx.Response:
        """One chat request about one of the origin's images; streamed ones ask for the usage chunk."""
        body: dict = {
            "model": "demo",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": question},
                        {"type": "image_url", "image_url": {"url": self.images[image]}},
                    ],
                }
            ],
            "max_tokens": 3,
            "temperature": 0,
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        response = httpx.post(
            f"{self.base_url}/v1/chat/completions", json=body, headers=self.processes.headers, timeout=60
        )
        ledger = self.ledger
        ledger.answered_at.append(time.time())
        ledger.requests += 1
        ledger.statuses[response.status_code] = ledger.statuses.get(response.status_code, 0) + 1
        if response.status_code == 200:
            usage = stream_usage(response.text) if stream else response.json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            ledger.prompt_tokens += usage["prompt_tokens"]
            ledger.completion_tokens += usage["completion_tokens"]
            ledger.cached_tokens += cached
            ledger.kv_hits += 1 if cached else 0
        return response

    def send_with_a_wrong_key(self) -> httpx.Response:
        """A chat request a client sends with a key nobody issued: a 401, a request all the same."""
        response = httpx.post(
            f"{self.base_url}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer sk-00000000.not-a-key-anyone-was-given-0000000000"},
            timeout=60,
        )
        self.ledger.answered_at.append(time.time())
        self.ledger.requests += 1
        self.ledger.refused_at_edge += 1
        self.ledger.statuses[response.status_code] = self.ledger.statuses.get(response.status_code, 0) + 1
        return response

    def statuses_text(self) -> str:
        """The ledger's statuses as routing_stats prints them: in code order."""
        return ", ".join(f"{status}: {n}" for status, n in sorted(self.ledger.statuses.items()))

    def staff_session(self) -> httpx.Client:
        """An HTTP client logged into the admin, as the browser is."""
        return self.processes.staff_session(ADMIN_USER, ADMIN_PASSWORD, self.base_url)

    def manage(self, *args: str) -> str:
        """A management command run as an operator would, against this platform."""
        return self.processes.manage(*args)


def stream_usage(events: str) -> dict:
    """The usage chunk of a server-sent event stream (its last chunk before [DONE])."""
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    (usage,) = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    return usage


def start_observed_platform(processes: PlatformProcesses, origin: ImageServer) -> ObservedPlatform:
    assert tuple(processes.start_sim_workers(WORKER_PROCESS, len(WORKERS))) == WORKERS
    processes.make_superuser(ADMIN_USER, ADMIN_PASSWORD)
    processes.wait_for_workers(*WORKERS)
    return ObservedPlatform(processes, processes.start_server(), origin)
