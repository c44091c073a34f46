"""Closed-loop load on one simulated engine in virtual time: what the calibration compares with
the native engine (bench/sim_calibration.py, tests/test_sim_engine.py), in modelled seconds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.api import DONE, ERROR, GenerationRequest, GenerationResult
from workers.kv_cache import KvPool
from workers.sim_engine.clock import SimClock
from workers.sim_engine.engine import SimEngine
from workers.sim_engine.profile import SimProfile


@dataclass(frozen=True)
class ReplayRequest:
    prompt_tokens: int
    max_tokens: int
    images: int = 0


@dataclass(frozen=True)
class ReplayResult:
    results: list[GenerationResult]
    seconds: float  # modelled, from the first request to the last answer
    forward_passes: int

    @property
    def tokens_per_s(self) -> float:
        return sum(r.completion_tokens for r in self.results) / self.seconds

    @property
    def ttft_mean_ms(self) -> float:
        """The mean, not the median: a closed loop's first requests queue behind each other, and
        the median of a few such lands on either side of a gap from run to run."""
        return statistics.fmean(r.ttft_ms for r in self.results)


def closed_loop(
    profile: SimProfile, requests: Sequence[ReplayRequest], concurrency: int, *, block_size: int = 16
) -> ReplayResult:
    """`concurrency` clients, each sending its next request when its last one is answered, on a
    cold engine; prompts share no block (as bench/engine_batching.py's do not)."""
    clock = SimClock(speedup=None)
    pool = KvPool(capacity_blocks=profile.kv_capacity_blocks, block_size=block_size, worker="replay")
    engine = SimEngine(name="replay", model_name="replay", profile=profile, pool=pool, clock=clock)
    pending = list(enumerate(requests))[::-1]
    in_flight, results = [], []

    def send() -> None:
        n, request = pending.pop()
        blocks = request.prompt_tokens // block_size
        in_flight.append(
            engine.submit(
                GenerationRequest(
                    request_id=f"replay-{n}",
                    prompt="",
                    images=[None] * request.images,  # type: ignore[list-item]
                    max_tokens=request.max_tokens,
                    prompt_tokens=request.prompt_tokens,
                    expected_block_hashes=tuple(range(n << 20, (n << 20) + blocks)),
                )
            )
        )

    for _ in range(min(concurrency, len(pending))):
        send()
    while clock.run_next():
        for handle in list(in_flight):
            while not handle.events.empty():
                kind, value = handle.events.get_nowait()
                if kind == ERROR:
                    raise value
                if kind == DONE:
                    results.append(value)
                    in_flight.remove(handle)
                    if pending:
                        send()
    return ReplayResult(results, clock.now(), engine.load_report().forward_passes)
