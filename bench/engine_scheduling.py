"""Time to first token of prefix-cache hits and of cold image prompts sharing one engine: the
`shortest_first` scheduler against `fcfs` (the engine's arrival order), on the same arrivals.

One engine in-process, the demo model, one torch thread. Open loop (Poisson arrivals, so a slow
answer does not slow the next arrival down): cold requests (a new 448 px picture, 256 image
tokens, and a new 300-word text) at COLD_RATE per second, and warm ones (one of WARM_PREFIXES
picture-and-text prefixes already in the cache, plus a new question of a few words) at
WARM_RATE, for DURATION_S seconds, over three seeds; caches are emptied and the warm prefixes
primed again before each run. Half of the engine's time goes to the cold prompts: a warm request
often arrives while one is being encoded or prefilled, which is where the policies differ.

Usage: .venv/bin/python bench/engine_scheduling.py  (model at MODEL_PATH, default
var/models/demo, built if absent; BENCH_DURATION_S shortens the runs while developing). About
2.5 minutes. The last line is machine-readable, each a ratio shortest_first / fcfs of medians
over the seeds:
warm_p90=<x.xx> warm_mean=<x.xx> cold_p50=<x.xx> cold_mean=<x.xx> identical=yes|no
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.samples import demo_model_dir, noise_png, quantile  # noqa: E402
from routing.media.images import url_identity  # noqa: E402
from workers.engine import Engine, GenerationRequest, ImageInput  # noqa: E402
from workers.scheduler import FCFS, SHORTEST_FIRST, Scheduler  # noqa: E402

SEEDS = (1, 2, 3)
POLICIES = (FCFS, SHORTEST_FIRST)
COLD_RATE = 2.0  # per second
WARM_RATE = 6.0
DURATION_S = float(os.environ.get("BENCH_DURATION_S", "20"))
WARM_PREFIXES = 4
TEXT_WORDS = 300
IMAGE_SIDE = 448  # the demo model's max_pixels: 256 image tokens
_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
_VOCABULARY = (
    "matte steel frame walnut handle linen cover brass hinge oak veneer ceramic glaze woven strap "
    "leather sole cotton lining glass lid copper base rubber grip velvet seat maple drawer wool"
)


def words(seed: str, count: int) -> str:
    rng, vocabulary = random.Random(seed), _VOCABULARY.split()
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def picture(key: str) -> ImageInput:
    return ImageInput(identity=url_identity(f"https://bench.test/{key}.png"), data=noise_png(key, IMAGE_SIDE))


def chat(request_id: str, image: ImageInput, text: str, question: str) -> GenerationRequest:
    prompt = f"<|im_start|>user\n{_VISION}{text}\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"
    return GenerationRequest(
        request_id=request_id, prompt=prompt, images=[image], max_tokens=4, ignore_eos=True
    )


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the run's start
    request: GenerationRequest
    warm: bool


def arrivals(seed: int, prefixes: list[tuple[ImageInput, str]]) -> list[Arrival]:
    """The same requests at the same instants for every policy."""
    rng = random.Random(seed)
    planned: list[Arrival] = []
    at = 0.0
    while True:
        at += rng.expovariate(COLD_RATE + WARM_RATE)
        if at >= DURATION_S:
            return planned
        n = len(planned)
        if rng.random() < WARM_RATE / (COLD_RATE + WARM_RATE):
            image, text = prefixes[n % len(prefixes)]
            request = chat(f"warm-{seed}-{n}", image, text, words(f"q{seed}-{n}", 8))
            planned.append(Arrival(at, request, True))
        else:
            key = f"cold-{seed}-{n}"
            planned.append(Arrival(at, chat(key, picture(key), words(key, TEXT_WORDS), "What is it?"), False))


@dataclass
class Run:
    policy: str
    seed: int
    warm_ms: list[float]
    cold_ms: list[float]
    texts: dict[str, str]


def run(engine: Engine, policy: str, seed: int, planned: list[Arrival], prefixes) -> Run:
    engine.scheduler = Scheduler(
        engine.kv_pool,
        max_batch_tokens=engine.scheduler.max_batch_tokens,
        max_running=engine.scheduler.max_running,
        policy=policy,
    )
    engine.clear_kv_cache()
    engine.embedding_cache.clear()
    for k, (image, text) in enumerate(prefixes):  # the warm prefixes, cached
        engine.generate(chat(f"prime-{seed}-{k}", image, text, "prime"))
    result = Run(policy, seed, [], [], {})
    lock = threading.Lock()

    def send(arrival: Arrival) -> None:
        answer = engine.generate(arrival.request)
        with lock:
            (result.warm_ms if arrival.warm else result.cold_ms).append(answer.ttft_ms)
            result.texts[arrival.request.request_id] = answer.text

    threads: list[threading.Thread] = []
    started = time.perf_counter()
    for arrival in planned:
        delay = started + arrival.at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=send, args=(arrival,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return result


def figures(runs: list[Run]) -> dict[str, float]:
    """Each figure's median over the seeds."""
    per_seed = [
        {
            "warm_p50": quantile(r.warm_ms, 0.5),
            "warm_p90": quantile(r.warm_ms, 0.9),
            "warm_mean": statistics.mean(r.warm_ms),
            "cold_p50": quantile(r.cold_ms, 0.5),
            "cold_mean": statistics.mean(r.cold_ms),
        }
        for r in runs
    ]
    return {name: statistics.median(seed[name] for seed in per_seed) for name in per_seed[0]}


def main() -> None:
    torch.set_num_threads(1)
    engine = Engine.load(demo_model_dir())
    prefixes = [(picture(f"warm-{k}"), words(f"warm-{k}", TEXT_WORDS)) for k in range(WARM_PREFIXES)]
    print(
        f"model {engine.model_name}, torch threads {torch.get_num_threads()}, {DURATION_S:g} s per run: "
        f"cold {COLD_RATE:g}/s (new picture and text), warm {WARM_RATE:g}/s (cached prefix, new question)"
    )
    runs: dict[str, list[Run]] = {policy: [] for policy in POLICIES}
    for seed in SEEDS:
        planned = arrivals(seed, prefixes)
        for policy in POLICIES if seed % 2 else reversed(POLICIES):  # neither always runs first
            result = run(engine, policy, seed, planned, prefixes)
            runs[policy].append(result)
            warm, cold = result.warm_ms, result.cold_ms
            print(
                f"[{policy:<14} seed {seed}] warm {len(warm)} p50 {quantile(warm, 0.5):.0f} ms "
                f"p90 {quantile(warm, 0.9):.0f} ms | cold {len(cold)} p50 {quantile(cold, 0.5):.0f} ms "
                f"p90 {quantile(cold, 0.9):.0f} ms",
                flush=True,
            )
    medians = {policy: figures(policy_runs) for policy, policy_runs in runs.items()}
    print(f"\nTTFT in ms, medians over {len(SEEDS)} seeds")
    print(f"{'policy':<16}" + "".join(f"{name:>11}" for name in medians[FCFS]))
    for policy, values in medians.items():
        print(f"{policy:<16}" + "".join(f"{value:>11.0f}" for value in values.values()))
    identical = all(a.texts == b.texts for a, b in zip(runs[FCFS], runs[SHORTEST_FIRST], strict=True))
    ratio = {name: medians[SHORTEST_FIRST][name] / medians[FCFS][name] for name in medians[FCFS]}
    print(
        f"warm_p90={ratio['warm_p90']:.2f} warm_mean={ratio['warm_mean']:.2f} "
        f"cold_p50={ratio['cold_p50']:.2f} cold_mean={ratio['cold_mean']:.2f} "
        f"identical={'yes' if identical else 'no'}"
    )
    engine.close()


if __name__ == "__main__":
    main()
