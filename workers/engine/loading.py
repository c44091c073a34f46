"""Loading the native engine from a local checkpoint, and the model facts it reads once."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from workers.embedding_cache import EmbeddingCache
from workers.kv_cache import KvPool
from workers.processors import load_processor
from workers.scheduler import DEFAULT_JOIN_TOKENS, SHORTEST_FIRST
from workers.video_inputs import VideoPreprocessor

if TYPE_CHECKING:
    from workers.engine.inputs import ImageLoader
    from workers.kv_cache import PublishEvents

# The engine class load_engine builds (Engine; a subclass in tests): loading names no engine.
EngineT = TypeVar("EngineT")

# Sized for a small model on a CPU: a step of this many tokens takes tens of milliseconds, so a
# prompt chunk delays the running decodes by about that much.
DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_MAX_RUNNING = 16


def load_engine(
    engine_class: type[EngineT],
    model_dir: Path,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    block_size: int = 16,
    kv_capacity_blocks: int = 4096,
    embedding_cache_bytes: int = 256 << 20,
    load_image: ImageLoader | None = None,
    publish_events: PublishEvents | None = None,
    worker_name: str = "local",
    model_name: str | None = None,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    max_running: int = DEFAULT_MAX_RUNNING,
    schedule_policy: str = SHORTEST_FIRST,
    prefill_join_tokens: int = DEFAULT_JOIN_TOKENS,
) -> EngineT:
    """Loads a local checkpoint (no hub access) into an engine, which announces an empty cache.

    The model, the KV pool and every tensor a step builds live on `device` (a torch device: cpu,
    cuda, cuda:1). `dtype` is the weights' and the pool's: "auto" is float32 on a CPU (bf16
    matmuls are slow there) and the checkpoint's own elsewhere (bf16 for Qwen's), or a torch
    dtype's name ("bfloat16", "float16", "float32")."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForImageTextToText

    from workers.engine.inputs import load_image_directly

    model_dir = Path(model_dir)
    processor = load_processor(model_dir)
    on_cpu = torch.device(device).type == "cpu"
    weights: Any = model_dtype(dtype, on_cpu=on_cpu)
    if on_cpu:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=weights).to(device).eval()
    else:
        # Straight onto the device: no copy of the whole model in host memory on the way.
        model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=weights, device_map=device
        ).eval()
    return engine_class(
        model=model,
        processor=processor,
        model_name=model_name or model_dir.name,
        device=device,
        kv_pool=KvPool(
            capacity_blocks=kv_capacity_blocks,
            block_size=block_size,
            worker=worker_name,
            publish_events=publish_events,
        ),
        embedding_cache=EmbeddingCache(embedding_cache_bytes),
        load_image=load_image or load_image_directly,
        max_batch_tokens=max_batch_tokens,
        max_running=max_running,
        schedule_policy=schedule_policy,
        prefill_join_tokens=prefill_join_tokens,
        video=VideoPreprocessor.for_model_dir(model_dir),
    )


def model_dtype(name: str, *, on_cpu: bool) -> Any:
    """The dtype `from_pretrained` gets for a `load_engine` dtype name ("auto": see there)."""
    import torch

    if name == "auto":
        return torch.float32 if on_cpu else "auto"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a torch floating-point dtype (bfloat16, float16, float32)")
    return dtype


def end_of_sequence_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The tokens that end an answer: the generation config's and the text config's, and the chat
    template's end markers where the tokenizer has them."""
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, model.config.text_config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    for token in ("<|im_end|>", "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return frozenset(ids)


def image_processor_fingerprint(image_processor: Any) -> str:
    """Names the image processor's settings: embeddings computed under others are not reused."""
    settings = json.dumps(image_processor.to_dict(), sort_keys=True, default=str)
    return xxhash.xxh3_64_hexdigest(settings.encode())


def video_fingerprint(video: VideoPreprocessor | None) -> str:
    """Video embeddings depend on the video settings, not the image processor's."""
    return xxhash.xxh3_64_hexdigest(video.fingerprint.encode()) if video is not None else "no-video"
