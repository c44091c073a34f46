"""The simulated engine in virtual time: its prefix pool caches the router's block hashes and
announces them, answers `cached_tokens` from them, evicts least recently used; its step times
are the profile's, over the native scheduler's steps; it never imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import pytest

from routing.contract.kv_events import KvEvent
from workers.engine.api import GenerationRequest, GenerationResult
from workers.kv_cache import KvPool
from workers.sim_engine.clock import SimClock
from workers.sim_engine.engine import SimEngine
from workers.sim_engine.profile import SimProfile, load_profile

BS = 16
PROFILE = SimProfile(
    name="test",
    step_base_ms=5.0,
    prefill_token_ms=0.1,
    decode_sequence_ms=1.0,
    image_encode_ms=40.0,
    max_batch_tokens=512,
    max_running=16,
)


class Recorded:
    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def __call__(self, events: Sequence[KvEvent]) -> None:
        self.events.extend(events)


def sim(capacity_blocks: int = 1024, profile: SimProfile = PROFILE) -> tuple[SimEngine, SimClock, Recorded]:
    clock, published = SimClock(speedup=None), Recorded()
    pool = KvPool(capacity_blocks=capacity_blocks, block_size=BS, worker="sim0", publish_events=published)
    engine = SimEngine(name="sim0", model_name="m", profile=profile, pool=pool, clock=clock)
    published.events.clear()  # the engine's opening `cleared`
    return engine, clock, published


def prompt(first_hash: int, blocks: int, *, tokens: int | None = None, **options) -> GenerationRequest:
    options.setdefault("max_tokens", 4)
    options.setdefault("images", [])
    return GenerationRequest(
        request_id=f"r{first_hash}-{blocks}-{tokens}",
        prompt="",
        expected_block_hashes=tuple(range(first_hash, first_hash + blocks)),
        prompt_tokens=tokens if tokens is not None else blocks * BS + 3,
        **options,
    )


def served(engine: SimEngine, clock: SimClock, *requests: GenerationRequest) -> list[GenerationResult]:
    handles = [engine.submit(r) for r in requests]
    clock.run_until_idle()
    results = []
    for handle in handles:
        while True:
            kind, value = handle.events.get_nowait()
            if kind == "done":
                results.append(value)
                break
            assert kind != "error", value
    return results


def test_a_repeated_prompt_is_answered_from_the_pool_with_the_routers_hashes():
    # given
    engine, clock, published = sim()
    # when
    (cold,) = served(engine, clock, prompt(100, 5))
    (warm,) = served(engine, clock, prompt(100, 5))
    # then
    assert cold.cached_tokens == 0 and warm.cached_tokens == 5 * BS
    stored = [e for e in published.events if e.kind == "stored"]
    assert [h for e in stored for h in e.block_hashes] == [100, 101, 102, 103, 104]
    assert engine.kv_block_hashes() == {100, 101, 102, 103, 104}
    assert warm.completion_tokens == 4 and warm.text == " sim" * 4


def test_the_pool_evicts_least_recently_used_blocks_and_announces_it():
    # given: room for 8 blocks; each request holds its 3 prompt blocks and one for its answer
    engine, clock, published = sim(capacity_blocks=8)
    served(engine, clock, prompt(100, 3))
    served(engine, clock, prompt(200, 3))
    served(engine, clock, prompt(100, 3))  # 100.. used again: 200.. is now the oldest
    # when
    served(engine, clock, prompt(300, 3))
    # then
    removed = {h for e in published.events if e.kind == "removed" for h in e.block_hashes}
    assert removed and removed <= {200, 201, 202}
    assert {100, 101, 102, 300, 301, 302} <= engine.kv_block_hashes()


def test_time_to_first_token_and_decode_steps_follow_the_profile():
    # given: a 99-token prompt (one step), 4 tokens out
    engine, clock, _ = sim()
    # when
    (result,) = served(engine, clock, prompt(100, 6, tokens=99))
    # then: prefill step = 5 + 99*0.1 ms; each of 3 more decode steps = 5 + 1 ms
    assert result.ttft_ms == pytest.approx(5 + 9.9)
    assert result.total_ms == pytest.approx(5 + 9.9 + 3 * 6)
    assert engine.load_report().forward_passes == 4


class StallingNeighbour:
    """Fault injection: another engine of the process whose step's bookkeeping holds the shared
    clock thread for 0.3 s of wall time (a busy machine, a thousand engines), once `go` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.steps = 1

    def begin_step(self, start: float) -> float | None:
        if self.steps:
            self.steps -= 1
            return 0.001
        return None

    def end_step(self, end: float) -> None:
        self.go.wait(10)
        time.sleep(0.3)


def test_in_scaled_real_time_a_lagging_clock_delays_the_tokens_but_not_the_times_the_engine_reports():
    # given: an engine in real time (speed-up 1) sharing its clock with a neighbour that stalls it
    clock = SimClock(speedup=1.0).start()
    pool = KvPool(capacity_blocks=1024, block_size=BS, worker="sim0")
    engine = SimEngine(name="sim0", model_name="m", profile=PROFILE, pool=pool, clock=clock)
    neighbour = StallingNeighbour()
    try:
        clock.wake(neighbour)
        # when: a 99-token prompt arrives, and the clock thread is held for 0.3 s meanwhile
        handle = engine.submit(prompt(100, 6, tokens=99))
        neighbour.go.set()
        kind, result = handle.events.get(timeout=10)
        while kind != "done":
            assert kind != "error", result
            kind, result = handle.events.get(timeout=10)
    finally:
        clock.stop()
    # then: the profile's times, as in virtual time (see the test of the profile's times), not the
    # 300 ms the process lost
    assert result.ttft_ms == pytest.approx(5 + 9.9)
    assert result.total_ms == pytest.approx(5 + 9.9 + 3 * 6)


def test_concurrent_requests_share_steps_as_the_native_scheduler_batches_them():
    # given
    engine, clock, _ = sim()
    # when: two prompts of 60 tokens (short enough to join one step), then shared decodes
    a, b = served(engine, clock, prompt(100, 3, tokens=60), prompt(200, 3, tokens=60))
    # then
    assert engine.load_report().forward_passes == 4
    assert a.ttft_ms == b.ttft_ms == pytest.approx(5 + 12)
    assert a.total_ms == pytest.approx(5 + 12 + 3 * (5 + 2))


def test_a_long_prompt_waits_for_a_step_of_its_own_as_in_the_native_engine():
    # given
    engine, clock, _ = sim()
    # when: two prompts of 99 tokens, longer than the profile's join limit (64)
    a, b = served(engine, clock, prompt(100, 6, tokens=99), prompt(200, 6, tokens=99))
    # then: the second prefills in the step after the first's
    assert a.ttft_ms == pytest.approx(5 + 9.9)
    assert b.ttft_ms == pytest.approx(5 + 9.9 + 5 + 9.9 + 1)


def test_a_waiting_prompt_of_a_higher_priority_prefills_first_as_in_the_native_engine():
    # given: two long prompts that cannot share a step, the second of a higher priority
    engine, clock, _ = sim()
    # when
    low, high = served(engine, clock, prompt(100, 6, tokens=99), prompt(200, 6, tokens=99, priority=9))
    # then: the later, higher one prefills first
    assert high.ttft_ms == pytest.approx(5 + 9.9)
    assert low.ttft_ms == pytest.approx(5 + 9.9 + 5 + 9.9 + 1)


def test_an_image_inside_the_cached_prefix_is_not_encoded_again():
    # given: an image whose placeholders end at token 40, a 99-token prompt
    engine, clock, _ = sim()
    image = {"images": [object()], "image_ends": (40,)}
    (cold,) = served(engine, clock, prompt(100, 6, tokens=99, **image))
    # when: the same image with another question (its first 3 blocks, 48 tokens, shared)
    other = prompt(100, 3, tokens=60, **image)
    other.expected_block_hashes = (100, 101, 102)
    (warm,) = served(engine, clock, other)
    # then
    assert cold.encoder_calls == 1 and warm.encoder_calls == 0
    assert cold.ttft_ms == pytest.approx(5 + 9.9 + 40)
    assert warm.cached_tokens == 48 and warm.ttft_ms == pytest.approx(5 + 1.2)


def test_the_shipped_profiles_load():
    for name in ("cpu-demo", "qwen2-vl-7b-h100", "qwen2-vl-7b-h200"):
        profile = load_profile(name)
        assert profile.step_seconds(512, 8, 1) > profile.step_seconds(0, 1) > 0


def test_a_simulated_worker_process_imports_no_torch():
    # what `run_worker --engine sim` imports before it serves, the Celery app's tasks included
    code = (
        "import sys, django; django.setup(); "
        "import inference_platform.celery, workers.tasks, workers.runtime, workers.sim_engine.fleet; "
        "from workers.management.commands import run_worker; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )
