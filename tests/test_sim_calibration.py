"""The simulated engine against the native one, without timing anything: fed the native engine's
prompt lengths and block hashes, it takes the same steps and finds the same cached prefixes; and
its CPU profile models the native engine's steps measured on this machine (bench/sim_calibration.py
wrote them into the profile: counted steps and the engine's CPU time) within 15%."""

from __future__ import annotations

import pytest

from tests.test_engine import LONG_TEXT, chat, image_input
from workers.engine.api import GenerationRequest
from workers.kv_cache import KvPool
from workers.sim_engine.clock import SimClock
from workers.sim_engine.engine import SimEngine
from workers.sim_engine.profile import load_profile
from workers.sim_engine.replay import ReplayRequest, closed_loop

CPU = load_profile("cpu-demo")


def test_fed_the_native_engines_hashes_the_simulator_takes_its_steps_and_finds_its_prefixes(demo_engine):
    # given: the native engine serves, one after another, prompts long and short, repeated in part
    native = demo_engine(capacity=512, max_batch_tokens=CPU.max_batch_tokens, max_running=CPU.max_running)
    texts = (LONG_TEXT * 3, "What is it?", LONG_TEXT * 3 + " again", "What is it?")
    prompts = [chat(text, images=1) for text in texts]
    native_results, native_steps = [], []
    for n, prompt in enumerate(prompts):
        before = native.forward_passes
        native_results.append(
            native.generate(
                GenerationRequest(f"n{n}", prompt, [image_input(n % 2)], max_tokens=5, ignore_eos=True)
            )
        )
        native_steps.append(native.forward_passes - before)
    # when: the simulator serves the same requests as the router would describe them
    clock = SimClock(speedup=None)
    pool = KvPool(capacity_blocks=512, block_size=16, worker="sim")
    sim = SimEngine(name="sim", model_name="demo", profile=CPU, pool=pool, clock=clock)
    sim_results, sim_steps = [], []
    for n, result in enumerate(native_results):
        before = sim.load_report().forward_passes
        handle = sim.submit(
            GenerationRequest(
                f"s{n}",
                "",
                [image_input(n % 2)],
                max_tokens=5,
                prompt_tokens=result.prompt_tokens,
                expected_block_hashes=tuple(result.block_hashes),
            )
        )
        clock.run_until_idle()
        sim_results.append(_done(handle))
        sim_steps.append(sim.load_report().forward_passes - before)
    # then
    assert sim_steps == native_steps
    assert [r.cached_tokens for r in sim_results] == [r.cached_tokens for r in native_results]
    assert any(r.cached_tokens for r in native_results)
    assert [r.completion_tokens for r in sim_results] == [5] * 4


def _done(handle):
    while True:
        kind, value = handle.events.get_nowait()
        if kind == "done":
            return value
        assert kind != "error", value


@pytest.mark.parametrize("load", sorted(CPU.reference.get("measured", {})))
def test_the_cpu_profile_models_the_native_engines_steps_within_15_percent(load):
    # given: what bench/sim_calibration.py measured of the native engine on this load (its steps,
    # and the engine thread's CPU time in them)
    mix, concurrency = load.rsplit("_c", 1)
    measured = CPU.reference["measured"][load]
    requests = [ReplayRequest(*row) for row in CPU.reference["workloads"][mix]]
    # when: the simulator serves the same load in virtual time
    modelled = closed_loop(CPU, requests, int(concurrency))
    # then: the same steps, and a modelled busy time within 15% (in a closed loop the engine is
    # never idle: its tok/s is tokens over that time, its TTFTs sums of those steps)
    assert modelled.forward_passes == measured["forward_passes"]
    assert modelled.seconds == pytest.approx(measured["busy_cpu_s"], rel=0.15)


GPU = load_profile("qwen2-vl-7b-h200")


def test_the_h200_profile_takes_the_native_engines_steps_and_its_busy_time_over_all_its_loads():
    # given: what bench/sim_calibration.py --device cuda measured of the native engine on an H200
    # (a Qwen2-VL-7B-sized model, random weights): its steps, and their wall time per load
    measured = GPU.reference["measured"]
    modelled_s = measured_s = 0.0
    for load in sorted(measured):
        mix, concurrency = load.rsplit("_c", 1)
        requests = [ReplayRequest(*row) for row in GPU.reference["workloads"][mix]]
        # when: the simulator serves the same load in virtual time
        modelled = closed_loop(GPU, requests, int(concurrency))
        # then: the same steps
        assert modelled.forward_passes == measured[load]["forward_passes"], load
        modelled_s += modelled.seconds
        measured_s += measured[load]["busy_s"]
    # and the same busy time over all the loads together: one load at a time it is off by up to
    # half (the profile's source.fit says where, and why)
    assert modelled_s == pytest.approx(measured_s, rel=0.15)
