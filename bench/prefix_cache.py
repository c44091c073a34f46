"""Time to first token of one worker's engine, cold versus a ~90% prefix KV hit with one image.

Usage: .venv/bin/python bench/prefix_cache.py  (model at MODEL_PATH, default var/models/demo,
built if absent). The last line is machine-readable:
ttft_cold_ms=<x> ttft_warm_ms=<x> speedup=<x.xx> encoder_skipped=yes|no
"""

from __future__ import annotations

import io
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.samples import demo_model_dir  # noqa: E402
from routing.media.images import url_identity  # noqa: E402
from workers.engine import Engine, GenerationRequest, GenerationResult, ImageInput  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "5"))
DOCUMENT_SENTENCES = 74  # about 1,550 tokens of text after the image
QUESTION_SENTENCES = 9  # about 190 tokens that change between warm requests

_SUBJECTS = ("the red apple", "a quiet garden", "the old bridge", "a bright window", "the small boat")
_PLACES = ("near the table", "behind the tower", "under a cloud", "beside the river", "in the kitchen")


def sentence(n: int) -> str:
    return (
        f"Line {n}: {_SUBJECTS[n % 5]} stands {_PLACES[(n // 5) % 5]} and looks {('calm', 'sharp')[n % 2]}."
    )


def photo() -> ImageInput:
    # 448x448: the demo's max_pixels, 256 image tokens.
    pixels = torch.randint(
        0, 256, (448, 448, 3), generator=torch.Generator().manual_seed(7), dtype=torch.uint8
    )
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, "PNG")
    return ImageInput(identity=url_identity("https://bench.test/photo.png"), data=buffer.getvalue())


def prompt(question_seed: int) -> str:
    document = " ".join(sentence(n) for n in range(DOCUMENT_SENTENCES))
    question = " ".join(sentence(1000 * (question_seed + 1) + n) for n in range(QUESTION_SENTENCES))
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|><|image_pad|><|vision_end|>{document}\nQuestion: {question} What is it?"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def run(engine: Engine, question_seed: int, image: ImageInput) -> GenerationResult:
    return engine.generate(
        GenerationRequest(
            request_id=f"bench-{question_seed}", prompt=prompt(question_seed), images=[image], max_tokens=8
        )
    )


def main() -> None:
    engine = Engine.load(demo_model_dir())
    image = photo()
    print(
        f"model {engine.model_name} ({engine.model_type}), "
        f"torch threads {torch.get_num_threads()}, runs {RUNS}"
    )
    for warm_up in (998, 999):  # first-call allocations and lazy imports, cold then warm
        run(engine, warm_up, image)

    rows: list[tuple[str, GenerationResult]] = []
    cold: list[GenerationResult] = []
    warm: list[GenerationResult] = []
    embedding_only: list[GenerationResult] = []
    for attempt in range(RUNS):
        engine.clear_kv_cache()
        engine.embedding_cache.clear()
        cold.append(run(engine, 0, image))
        rows.append(("cold", cold[-1]))
        # A different final question each time: only the shared prefix can come from the cache.
        warm.append(run(engine, attempt + 1, image))
        rows.append(("warm", warm[-1]))
        engine.clear_kv_cache()  # a KV miss whose image embedding is still cached
        embedding_only.append(run(engine, 100 + attempt, image))
        rows.append(("kv-miss/emb-hit", embedding_only[-1]))

    print(f"{'run':<16}{'prompt':>8}{'cached':>8}{'ttft ms':>10}{'prefill ms':>12}{'encoder':>9}")
    for label, result in rows:
        print(
            f"{label:<16}{result.prompt_tokens:>8}{result.cached_tokens:>8}{result.ttft_ms:>10.1f}"
            f"{result.prefill_ms:>12.1f}{result.encoder_calls:>9}"
        )
    cold_ms = statistics.median(r.ttft_ms for r in cold)
    warm_ms = statistics.median(r.ttft_ms for r in warm)
    embedding_ms = statistics.median(r.ttft_ms for r in embedding_only)
    cached_share = statistics.median(r.cached_tokens / r.prompt_tokens for r in warm)
    skipped = all(r.encoder_calls == 0 for r in warm)
    print(
        f"median ttft: cold {cold_ms:.1f} ms, warm {warm_ms:.1f} ms "
        f"({cached_share:.0%} of the prompt cached),"
    )
    print(f"  kv miss with the image embedding cached {embedding_ms:.1f} ms")
    print(
        f"ttft_cold_ms={cold_ms:.1f} ttft_warm_ms={warm_ms:.1f} speedup={cold_ms / warm_ms:.2f} "
        f"encoder_skipped={'yes' if skipped else 'no'}"
    )


if __name__ == "__main__":
    main()
