"""Throughput and time to first token of one worker engine under concurrent load (continuous
batching), against the raw limit of the same model on this machine.

One engine in-process, the demo model, one torch thread. Closed-loop clients at concurrency 1, 4,
8 and 16 on two mixes: decode-heavy (prompts of 256 tokens, a quarter with a small image, 128
output tokens each) and prefill-heavy (prompts of about 2,000 tokens, 16 output tokens). The raw
limit is the plain transformers forward on the first 8 decode-heavy requests: their prefills one
by one, then decode steps at batch 8 with a DynamicCache (equal lengths, greedy), nothing else.

Usage: .venv/bin/python bench/engine_batching.py  (model at MODEL_PATH, default var/models/demo,
built if absent; BENCH_REQUESTS / BENCH_PREFILL_REQUESTS shrink the runs while developing).
The last line is machine-readable (decode-heavy mix):
tok_s_c1=… tok_s_c8=… speedup_c8=… raw_c8_tok_s=… engine_over_raw_c8=… ttft_p50_c8_over_c1=… identical=yes|no
"""

from __future__ import annotations

import io
import os
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
from PIL import Image  # noqa: E402

from bench.samples import demo_model_dir  # noqa: E402
from routing.media.images import url_identity  # noqa: E402
from workers.engine import Engine, GenerationRequest, GenerationResult, ImageInput  # noqa: E402

CONCURRENCY = (1, 4, 8, 16)
DECODE_REQUESTS = int(os.environ.get("BENCH_REQUESTS", "32"))
PREFILL_REQUESTS = int(os.environ.get("BENCH_PREFILL_REQUESTS", "16"))
DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS = 256, 128
PREFILL_PROMPT_TOKENS, PREFILL_OUTPUT_TOKENS = 2000, 16
RAW_BATCH = 8

_WORDS = [
    "apple",
    "river",
    "garden",
    "bridge",
    "window",
    "tower",
    "cloud",
    "forest",
    "island",
    "kitchen",
    "table",
    "bottle",
    "castle",
    "mountain",
    "ocean",
    "summer",
    "winter",
    "pattern",
    "shadow",
    "mirror",
    "basket",
    "ticket",
    "letter",
    "camera",
    "horse",
]
_FILLER = " ."  # one token each in the demo tokenizer (checked when prompts are built)


@dataclass
class Level:
    concurrency: int
    results: list[GenerationResult]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(r.completion_tokens for r in self.results) / self.seconds

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(r.ttft_ms for r in self.results)


def small_image(seed: int, size: int = 112) -> ImageInput:
    # 112x112: a grid of 8x8 patches, 16 image tokens in the demo model (448x448: 256)
    pixels = torch.randint(
        0, 256, (size, size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
    )
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, "PNG")
    return ImageInput(identity=url_identity(f"https://bench.test/{seed}.png"), data=buffer.getvalue())


def build_request(
    engine: Engine, n: int, tokens: int, output: int, with_image: bool, image_size: int = 112
) -> GenerationRequest:
    """A prompt of exactly `tokens` tokens, distinct from its first block on (no prefix reuse);
    with an image, a square of `image_size` pixels of noise."""
    images = [small_image(n, image_size)] if with_image else []
    vision = "<|vision_start|><|image_pad|><|vision_end|>" if with_image else ""
    words = " ".join(_WORDS[(n * 7 + i) % len(_WORDS)] for i in range(tokens))
    head = f"<|im_start|>user\nRequest {n}: {vision}"
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    pil = [Image.open(io.BytesIO(image.data)) for image in images]

    def count(body: str) -> int:
        return len(engine.prompt_token_ids(head + body + tail, pil))

    body = words
    while count(body) > tokens:  # drop words until it fits, then pad one token at a time
        body = body.rsplit(" ", 1)[0]
    while count(body) < tokens:
        body += _FILLER
    assert count(body) == tokens, "the filler is not one token in this tokenizer"
    return GenerationRequest(
        request_id=f"bench-{n}",
        prompt=head + body + tail,
        images=images,
        max_tokens=output,
        ignore_eos=True,
    )


def run_level(engine: Engine, requests: list[GenerationRequest], concurrency: int) -> Level:
    """Closed loop: `concurrency` clients, each sending its next request when the last returns."""
    engine.clear_kv_cache()  # every level starts cold: batching is measured, not caching
    engine.embedding_cache.clear()
    results: list[GenerationResult | None] = [None] * len(requests)
    cursor = iter(range(len(requests)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            results[index] = engine.generate(requests[index])

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Level(concurrency, [r for r in results if r is not None], time.perf_counter() - started)


def raw_limit(engine: Engine, requests: list[GenerationRequest]) -> tuple[float, list[str]]:
    """Tokens/s of the plain forward call on these requests (equal prompt lengths), and the texts."""
    from transformers import DynamicCache

    model, processor = engine.model, engine.processor
    output = requests[0].max_tokens
    caches, deltas, first_tokens = [], [], []
    started = time.perf_counter()
    with torch.inference_mode():
        for request in requests:  # prefills one by one
            pil = [Image.open(io.BytesIO(image.data)) for image in request.images]
            inputs = processor(text=[request.prompt], images=pil or None, return_tensors="pt")
            positions, delta = model.model.get_rope_index(
                inputs["input_ids"],
                mm_token_type_ids=inputs["mm_token_type_ids"],
                image_grid_thw=inputs.get("image_grid_thw"),
            )
            result = model(**inputs, position_ids=positions, use_cache=True, logits_to_keep=1)
            caches.append(result.cache)
            deltas.append(int(delta.reshape(-1)[0]))
            first_tokens.append(int(result.logits[0, -1].argmax()))
        length = inputs["input_ids"].shape[1]
        layers = len(caches[0].layers)
        cache = DynamicCache(
            [
                (
                    torch.cat([c.layers[layer].keys for c in caches]),
                    torch.cat([c.layers[layer].values for c in caches]),
                )
                for layer in range(layers)
            ]
        )
        tokens = torch.tensor(first_tokens).unsqueeze(1)
        generated = [tokens]
        delta = torch.tensor(deltas)
        for step in range(output - 1):  # decode steps at batch 8
            position = (length + step + delta).view(1, -1, 1).expand(3, -1, 1)
            result = model(input_ids=tokens, position_ids=position, cache=cache, use_cache=True)
            cache = result.cache
            tokens = result.logits[:, -1].argmax(-1, keepdim=True)
            generated.append(tokens)
    seconds = time.perf_counter() - started
    ids = torch.cat(generated, dim=1)
    texts = [engine.tokenizer.decode(row, skip_special_tokens=True) for row in ids.tolist()]
    return len(requests) * output / seconds, texts


def report(name: str, levels: list[Level]) -> None:
    base = levels[0]
    print(f"\n{name}")
    print(f"{'clients':>8}{'requests':>10}{'tok/s':>10}{'speedup':>9}{'ttft p50 ms':>13}{'ttft p90 ms':>13}")
    for level in levels:
        ttfts = sorted(r.ttft_ms for r in level.results)
        p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
        print(
            f"{level.concurrency:>8}{len(level.results):>10}{level.tokens_per_s:>10.0f}"
            f"{level.tokens_per_s / base.tokens_per_s:>9.2f}{level.ttft_p50_ms:>13.1f}{p90:>13.1f}"
        )


def main() -> None:
    torch.set_num_threads(1)
    engine = Engine.load(demo_model_dir())
    print(
        f"model {engine.model_name} ({engine.model_type}), torch threads {torch.get_num_threads()}, "
        f"max batch tokens {engine.scheduler.max_batch_tokens}, max running {engine.scheduler.max_running}"
    )
    decode = [
        build_request(engine, n, DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS, with_image=n % 4 == 1)
        for n in range(max(DECODE_REQUESTS, RAW_BATCH))
    ]
    prefill = [
        build_request(engine, 1000 + n, PREFILL_PROMPT_TOKENS, PREFILL_OUTPUT_TOKENS, with_image=n % 4 == 1)
        for n in range(PREFILL_REQUESTS)
    ]
    run_level(engine, decode[:2], 2)  # warm-up: first-call allocations and lazy imports

    decode_levels = [run_level(engine, decode[:DECODE_REQUESTS], c) for c in CONCURRENCY]
    prefill_levels = [run_level(engine, prefill, c) for c in CONCURRENCY]
    raw_tok_s, raw_texts = raw_limit(engine, decode[:RAW_BATCH])

    report(
        f"decode-heavy: {DECODE_PROMPT_TOKENS}-token prompts, {DECODE_OUTPUT_TOKENS} output tokens",
        decode_levels,
    )
    report(
        f"prefill-heavy: {PREFILL_PROMPT_TOKENS}-token prompts, {PREFILL_OUTPUT_TOKENS} output tokens",
        prefill_levels,
    )
    alone = [r.text for r in decode_levels[0].results]
    identical = all([r.text for r in level.results] == alone for level in decode_levels)
    identical &= all(
        [r.text for r in level.results] == [r.text for r in prefill_levels[0].results]
        for level in prefill_levels
    )
    identical &= raw_texts == alone[:RAW_BATCH]
    by = {level.concurrency: level for level in decode_levels}
    c1, c8 = by[1], by[8]
    print(
        f"\nraw transformers forward, {RAW_BATCH} requests (prefills one by one, then batch-{RAW_BATCH} "
        f"decode): {raw_tok_s:.0f} tok/s"
    )
    print(
        f"tok_s_c1={c1.tokens_per_s:.0f} tok_s_c8={c8.tokens_per_s:.0f} "
        f"speedup_c8={c8.tokens_per_s / c1.tokens_per_s:.2f} raw_c8_tok_s={raw_tok_s:.0f} "
        f"engine_over_raw_c8={c8.tokens_per_s / raw_tok_s:.2f} "
        f"ttft_p50_c8_over_c1={c8.ttft_p50_ms / c1.ttft_p50_ms:.2f} identical={'yes' if identical else 'no'}"
    )
    engine.close()


if __name__ == "__main__":
    main()
