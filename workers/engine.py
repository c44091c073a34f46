"""The worker's inference engine: a transformers Qwen2-VL or LLaVA family model that reuses cached
prefix KV (images included) and cached image embeddings, and generates one request at a time.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash
from PIL import Image

from routing.hashing import MediaPlacement, chain_sequence_hashes, local_block_hashes
from routing.kv_events import KvEvent
from routing.media import MediaPolicy, decode_data_url, decode_image, fetch_bytes, is_data_url, routing_hash
from routing.processor_view import token_runs
from workers.demo_model import load_processor
from workers.embedding_cache import EmbeddingCache, EmbeddingKey
from workers.kv_cache import PrefixKvCache, PrefixLease, prefix_kv

if TYPE_CHECKING:
    import torch

PublishEvents = Callable[[Sequence[KvEvent]], None]
logger = logging.getLogger("workers.engine")

# Families whose images are fixed tiles of a CLIP-like tower and whose positions are 1-D (no M-RoPE).
LLAVA_MODEL_TYPES = frozenset({"llava", "llava_next"})


class PromptError(ValueError):
    """A request the engine cannot run as sent; `status` is what the API answers with."""

    status = 400
    code = "invalid_prompt"


@dataclass
class ImageInput:
    identity: str  # 32-hex identity from the frontend
    url: str | None = None
    data: bytes | None = None  # encoded bytes handed over when frontend decoding is on
    # The size the frontend read from the image's header. With it, the prompt is laid out before
    # any image is loaded, and an image inside the cached prefix is never fetched at all.
    width: int | None = None
    height: int | None = None
    # E/PD: the image's features from an encode worker (workers.embedding_transfer), already
    # checked against their checksum. Used instead of the vision tower when their row count fits
    # the image's placeholder tokens; otherwise the engine encodes the image itself (a fallback).
    embedding: torch.Tensor | None = None


@dataclass(frozen=True)
class _DeclaredSize:
    width: int
    height: int


@dataclass
class GenerationRequest:
    request_id: str
    prompt: str  # chat-templated; one image placeholder per image (<|image_pad|> or <image>)
    images: list[ImageInput]
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    scope_key: str | None = None  # session scope hash when scoping is on
    # False when scoping is on and the request has no scope: it must not read or fill shared caches.
    use_embedding_cache: bool = True
    # The frontend processor's model inputs (routing.processor_view.decode_processed): input_ids,
    # pixel_values, and image_grid_thw (Qwen) or image_sizes (LLaVA-NeXT). When present the engine
    # neither loads nor preprocesses images.
    processed: dict[str, Any] | None = None


@dataclass
class GenerationResult:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    prefill_ms: float
    total_ms: float
    encoder_calls: int
    embedding_cache_hits: int
    embedding_cache_misses: int
    block_hashes: list[int]  # of the prompt
    embeddings_received: int = 0  # E/PD: images whose encode worker's features were used
    embedding_fallbacks: int = 0  # E/PD: received features that did not fit, encoded here instead


ImageLoader = Callable[[ImageInput, str | None], Image.Image]


def load_image_directly(image: ImageInput, scope_key: str | None = None) -> Image.Image:
    """The default loader: handed-over bytes, a data URL, or an http(s) fetch through the guard."""
    policy = MediaPolicy()
    if image.data is not None:
        data = image.data
    elif image.url is None:
        raise PromptError(f"image {image.identity} has neither bytes nor a URL")
    elif is_data_url(image.url):
        data = decode_data_url(image.url, max_bytes=policy.max_bytes)
    else:
        data = fetch_bytes(image.url, policy, expect_image=True)
    return decode_image(data, policy)


@dataclass
class _PromptImage:
    source: ImageInput
    start: int  # first placeholder token
    length: int  # placeholder tokens
    # Qwen: vision patches (temporal, height, width) before merging; None for LLaVA's fixed tiles.
    grid_thw: tuple[int, int, int] | None
    image: Image.Image | None = None  # decoded, for the worker's own preprocessing
    # Or the frontend's preprocessing: all of the request's pixel_values and this image's rows.
    # Sliced only when the image is encoded, so an image inside the reused prefix stays untouched.
    pixel_values: torch.Tensor | None = None
    pixel_rows: tuple[int, int] = (0, 0)
    image_sizes: torch.Tensor | None = None  # LLaVA-NeXT: the request's (height, width) rows


@dataclass
class _RequestCounters:
    encoder_calls: int = 0
    embedding_hits: int = 0
    embedding_misses: int = 0
    embeddings_received: int = 0
    embedding_fallbacks: int = 0


class Engine:
    """A loaded model with its processor, prefix KV cache and embedding cache."""

    def __init__(
        self,
        *,
        model: Any,
        processor: Any,
        model_name: str,
        device: str,
        kv_cache: PrefixKvCache,
        embedding_cache: EmbeddingCache,
        load_image: ImageLoader,
    ) -> None:
        import torch

        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.model_name = model_name
        self.model_type: str = model.config.model_type
        self.device = torch.device(device)
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.embedding_cache = embedding_cache
        self._load_image = load_image
        self._lock = threading.Lock()
        self.image_token = processor.image_token
        self.image_token_id: int = model.config.image_token_id
        # LLaVA runs the text model on 1-D positions; Qwen's M-RoPE needs the image grids.
        self.uses_mrope = self.model_type not in LLAVA_MODEL_TYPES
        self._eos_ids = self._end_of_sequence_ids()
        self.processor_fingerprint = self._fingerprint_image_processor()
        # An `llm` worker drops the vision tower after loading (encode workers compute its images'
        # features); it is read back from this checkpoint on the first fallback.
        self.vision_unloaded_from: Path | None = None
        self.on_vision_loaded: Callable[[Any], None] | None = None  # gets the tower (hooks)
        # The index may still list blocks of this worker's previous life: say it holds nothing.
        kv_cache.clear()

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        device: str = "cpu",
        block_size: int = 16,
        kv_capacity_blocks: int = 4096,
        embedding_cache_bytes: int = 256 << 20,
        load_image: ImageLoader | None = None,
        publish_events: PublishEvents | None = None,
        worker_name: str = "local",
        model_name: str | None = None,
    ) -> Engine:
        """Loads a local checkpoint (no hub access) and announces an empty cache (`cleared`)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForImageTextToText

        model_dir = Path(model_dir)
        processor = load_processor(model_dir)
        # float32 on CPU (bf16 matmuls are slow there); the checkpoint's own dtype on accelerators.
        dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        kv_cache = PrefixKvCache(
            capacity_blocks=kv_capacity_blocks,
            block_size=block_size,
            worker=worker_name,
            publish_events=publish_events,
        )
        engine = cls(
            model=model,
            processor=processor,
            model_name=model_name or model_dir.name,
            device=device,
            kv_cache=kv_cache,
            embedding_cache=EmbeddingCache(embedding_cache_bytes),
            load_image=load_image or load_image_directly,
        )
        return engine

    # --- public ------------------------------------------------------------------------------------
    def generate(
        self,
        request: GenerationRequest,
        *,
        on_token: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Prefills what the prefix cache lacks, then decodes; thread-safe (one request at a time)."""
        if request.max_tokens < 1:
            raise PromptError("max_tokens must be >= 1")
        started = time.perf_counter()
        input_ids, placed = self._prompt(request)
        media = [MediaPlacement(routing_hash(p.source.identity), p.start, p.length) for p in placed]
        local_hashes = local_block_hashes(input_ids, self.block_size, media)
        sequence_hashes = chain_sequence_hashes(local_hashes)
        # Images load outside the model lock (fetching must not hold up another request's
        # decode), and only those the cached prefix does not wholly cover. The look is not a
        # hold: pinning blocks while waiting for the lock would keep them from eviction.
        self._load_uncovered(placed, self._cached_tokens(sequence_hashes, len(input_ids)), request.scope_key)
        with self._lock:
            lease = self.kv_cache.acquire(sequence_hashes)
            try:
                # Evicted meanwhile (rare): what the prefix no longer covers loads now.
                self._load_uncovered(
                    placed, min(lease.reused_blocks * self.block_size, len(input_ids) - 1), request.scope_key
                )
                return self._generate(
                    request, input_ids, placed, local_hashes, sequence_hashes, lease, started,
                    on_token, on_first_token, should_stop,
                )  # fmt: skip
            finally:
                self.kv_cache.release(lease)

    def _cached_tokens(self, sequence_hashes: list[int], prompt_tokens: int) -> int:
        """Prompt tokens the cache would reuse right now (at least the last token always runs)."""
        lease = self.kv_cache.acquire(sequence_hashes)
        self.kv_cache.release(lease)
        return min(lease.reused_blocks * self.block_size, prompt_tokens - 1)

    def _load_uncovered(self, placed: list[_PromptImage], reused: int, scope_key: str | None) -> None:
        for image in placed:
            if image.source.embedding is not None and image.source.embedding.shape[0] == image.length:
                continue  # E/PD: an encode worker's features stand in for the pixels
            if image.image is None and image.pixel_values is None and image.start + image.length > reused:
                image.image = self._load_declared(image.source, scope_key)

    def unload_vision(self, model_dir: Path) -> None:
        """Frees the vision tower and projector (`run_worker --role llm`)."""
        import torch

        from workers.vision_encoder import VISION_PARTS

        with self._lock:
            for part in VISION_PARTS[self.model_type]:
                module = getattr(self.model.model, part)
                if isinstance(module, torch.nn.Parameter):
                    setattr(
                        self.model.model, part, torch.nn.Parameter(module.to("meta"), requires_grad=False)
                    )
                else:
                    module.to("meta")
            self.vision_unloaded_from = Path(model_dir)

    def load_vision(self) -> None:
        """Reads the vision parts back from the checkpoint (an `llm` worker's first fallback)."""
        from workers.vision_encoder import load_vision_parts, vision_tower

        if self.vision_unloaded_from is None:
            return
        logger.warning("loading the vision tower back from %s to encode locally", self.vision_unloaded_from)
        dtype = next(self.model.model.language_model.parameters()).dtype
        load_vision_parts(self.model.model, self.vision_unloaded_from, device=str(self.device), dtype=dtype)
        self.vision_unloaded_from = None
        if self.on_vision_loaded is not None:
            self.on_vision_loaded(vision_tower(self.model.model, self.model_type))

    @property
    def vision_loaded(self) -> bool:
        return self.vision_unloaded_from is None

    def clear_kv_cache(self) -> int:
        return self.kv_cache.clear()

    def kv_block_hashes(self) -> set[int]:
        return self.kv_cache.block_hashes()

    def prompt_token_ids(self, prompt: str, images: Sequence[Image.Image]) -> list[int]:
        """The prompt's token ids with each image placeholder expanded, as the model sees them."""
        return self._expand_prompt(prompt, [ImageInput(identity="0" * 32)] * len(images), images)[0]

    # --- prompt --------------------------------------------------------------------------------------
    def _prompt(self, request: GenerationRequest) -> tuple[list[int], list[_PromptImage]]:
        """The input ids and image spans; images are loaded here only if their size is unknown."""
        if request.processed is not None:
            return self._processed_prompt(request)
        if all(image.width and image.height for image in request.images):
            sizes = [_DeclaredSize(int(image.width), int(image.height)) for image in request.images]  # type: ignore[arg-type]
            return self._expand_prompt(request.prompt, request.images, sizes)
        loaded = [self._load_image(image, request.scope_key) for image in request.images]
        return self._expand_prompt(request.prompt, request.images, loaded)

    def _load_declared(self, source: ImageInput, scope_key: str | None) -> Image.Image:
        """An image laid out from its declared size, loaded now; it must still have that size."""
        image = self._load_image(source, scope_key)
        if (image.width, image.height) != (source.width, source.height):
            raise PromptError(
                f"image {source.identity} is {image.width}x{image.height} now but was "
                f"{source.width}x{source.height} when the request was routed: it changed at its origin"
            )
        return image

    def _expand_prompt(
        self, prompt: str, inputs: Sequence[ImageInput], images: Sequence[Image.Image | _DeclaredSize]
    ) -> tuple[list[int], list[_PromptImage]]:
        # Token counts come from the image size alone (the processor's own smart_resize), so an
        # image covered by the cached prefix is never preprocessed (ENGINE-NOTES trap 7).
        parts = prompt.split(self.image_token)
        if len(parts) - 1 != len(images):
            raise PromptError(f"the prompt has {len(parts) - 1} image placeholders for {len(images)} images")
        if "<|video_pad|>" in prompt:
            raise PromptError("video inputs are not supported by this engine")
        ids: list[int] = []
        placed: list[_PromptImage] = []
        for index, part in enumerate(parts):
            # Special tokens split the text before BPE runs, so tokenizing between them is exact.
            ids.extend(self.tokenizer(part, add_special_tokens=False)["input_ids"])
            if index < len(images):
                length, grid = self._image_tokens(images[index])
                image = images[index]
                loaded = image if isinstance(image, Image.Image) else None
                placed.append(_PromptImage(inputs[index], len(ids), length, grid, image=loaded))
                ids.extend([self.image_token_id] * length)
        return ids, placed

    def _processed_prompt(self, request: GenerationRequest) -> tuple[list[int], list[_PromptImage]]:
        """The frontend processor's input ids and image spans, checked against the request's
        images and their grids: a payload that disagrees with itself is refused, not run."""
        import torch

        processed = request.processed or {}
        if "pixel_values_videos" in processed or "video_grid_thw" in processed:
            raise PromptError("video inputs are not supported by this engine")
        try:
            ids = torch.as_tensor(processed["input_ids"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise PromptError("the processed inputs carry no usable input_ids") from exc
        if ids.is_floating_point() or ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
            raise PromptError(f"processed input_ids must be one prompt's integer ids, not {tuple(ids.shape)}")
        input_ids = [int(i) for i in ids.reshape(-1).tolist()]
        vocab = self.model.get_input_embeddings().num_embeddings
        if not input_ids or min(input_ids) < 0 or max(input_ids) >= vocab:
            raise PromptError(
                f"processed input_ids must be non-empty and inside the vocabulary (0..{vocab - 1})"
            )
        video_token_id = getattr(self.model.config, "video_token_id", None)
        if video_token_id is not None and video_token_id in input_ids:
            raise PromptError("video inputs are not supported by this engine")
        if not self.uses_mrope:
            return input_ids, self._llava_processed_images(request, input_ids, processed)

        spans = token_runs(input_ids, self.image_token_id)
        if len(spans) != len(request.images):
            raise PromptError(
                f"the processed input ids hold {len(spans)} image spans for {len(request.images)} images"
            )
        if not spans:
            return input_ids, []
        grids, pixel_values = processed.get("image_grid_thw"), processed.get("pixel_values")
        if not isinstance(grids, torch.Tensor) or not isinstance(pixel_values, torch.Tensor):
            raise PromptError("processed inputs with images need pixel_values and image_grid_thw tensors")
        if grids.is_floating_point() or tuple(grids.shape) != (len(spans), 3):
            raise PromptError(
                f"image_grid_thw must be {len(spans)} rows of (t, h, w), not {tuple(grids.shape)}"
            )
        processor = self.image_processor
        patch_values = 3 * processor.temporal_patch_size * processor.patch_size**2
        if (
            not pixel_values.is_floating_point()
            or pixel_values.dim() != 2
            or pixel_values.shape[1] != patch_values
        ):
            raise PromptError(
                f"pixel_values must be (patches, {patch_values}) floats, not {tuple(pixel_values.shape)}"
            )

        merge = processor.merge_size
        placed: list[_PromptImage] = []
        row = 0
        for index, (source, (start, end), grid) in enumerate(
            zip(request.images, spans, grids.tolist(), strict=True)
        ):
            t, h, w = (int(n) for n in grid)
            if min(t, h, w) < 1 or h % merge or w % merge:
                raise PromptError(f"image {index}'s grid {(t, h, w)} does not merge by {merge}")
            patches = t * h * w
            if end - start != patches // merge**2:
                raise PromptError(
                    f"image {index} has {end - start} placeholder tokens, its grid {(t, h, w)} "
                    f"makes {patches // merge**2}"
                )
            placed.append(
                _PromptImage(
                    source,
                    start,
                    end - start,
                    (t, h, w),
                    pixel_values=pixel_values,
                    pixel_rows=(row, row + patches),
                )
            )
            row += patches
        if row != pixel_values.shape[0]:
            raise PromptError(
                f"the image grids cover {row} pixel patches, pixel_values has {pixel_values.shape[0]}"
            )
        return input_ids, placed

    def _llava_processed_images(
        self, request: GenerationRequest, input_ids: list[int], processed: dict[str, Any]
    ) -> list[_PromptImage]:
        """LLaVA images in the frontend's input ids. Adjacent images make one run of `<image>`
        tokens (nothing separates them), so runs are cut by each image's own token count."""
        import torch

        runs = token_runs(input_ids, self.image_token_id)
        count = len(request.images)
        if not count:
            if runs:
                raise PromptError("the processed input ids hold image tokens but the request has no images")
            return []
        pixel_values, image_sizes = processed.get("pixel_values"), processed.get("image_sizes")
        next_family = self.model_type == "llava_next"
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            raise PromptError("processed inputs with images need a float pixel_values tensor")
        rank = 5 if next_family else 4
        if pixel_values.dim() != rank or pixel_values.shape[0] != count:
            raise PromptError(
                f"pixel_values must hold {count} images in {rank} dimensions, not {tuple(pixel_values.shape)}"
            )
        if next_family:
            if (
                not isinstance(image_sizes, torch.Tensor)
                or image_sizes.is_floating_point()
                or tuple(image_sizes.shape) != (count, 2)
                or int(image_sizes.min()) < 1
            ):
                raise PromptError(
                    f"LLaVA-NeXT processed inputs need image_sizes of {count} (height, width) rows"
                )
            sizes = [(int(h), int(w)) for h, w in image_sizes.tolist()]
        else:
            tile = self.image_processor.crop_size
            if tuple(pixel_values.shape[-2:]) != (tile["height"], tile["width"]):
                raise PromptError(
                    f"pixel_values tiles must be {tile['height']}x{tile['width']}, "
                    f"not {tuple(pixel_values.shape[-2:])}"
                )
            sizes = [(tile["height"], tile["width"])] * count  # LLaVA-1.5's count ignores the size
        lengths = self.processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]

        placed: list[_PromptImage] = []
        runs_left = list(runs)
        position = runs_left[0][0] if runs_left else 0
        for index, (source, length) in enumerate(zip(request.images, lengths, strict=True)):
            if not runs_left:
                raise PromptError(f"the processed input ids have no image tokens left for image {index}")
            run_end = runs_left[0][1]
            if position + length > run_end:
                raise PromptError(
                    f"image {index} needs {length} image tokens, its run has {run_end - position}"
                )
            placed.append(
                _PromptImage(
                    source,
                    position,
                    int(length),
                    None,
                    pixel_values=pixel_values,
                    pixel_rows=(index, index + 1),
                    image_sizes=image_sizes if next_family else None,
                )
            )
            position += length
            if position == run_end:
                runs_left.pop(0)
                position = runs_left[0][0] if runs_left else position
        if runs_left:
            raise PromptError(f"the processed input ids hold more image tokens than the {count} images make")
        return placed

    def _image_tokens(self, image: Image.Image | _DeclaredSize) -> tuple[int, tuple[int, int, int] | None]:
        """Placeholder tokens of an image (and Qwen's patch grid), from its size alone."""
        if self.uses_mrope:
            grid = self._image_grid(image)
            return grid[0] * grid[1] * grid[2] // self.image_processor.merge_size**2, grid
        # The processor's own size-only count (the hook vLLM uses; no pixels, so an image inside the
        # reused prefix is never preprocessed): LLaVA-1.5's fixed tile, LLaVA-NeXT's anyres grid.
        counts = self.processor._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)])
        return int(counts["num_image_tokens"][0]), None

    def _image_grid(self, image: Image.Image | _DeclaredSize) -> tuple[int, int, int]:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        processor = self.image_processor
        patch = processor.patch_size
        height, width = smart_resize(
            image.height,
            image.width,
            factor=patch * processor.merge_size,
            min_pixels=processor.size["shortest_edge"],
            max_pixels=processor.size["longest_edge"],
        )
        return (1, height // patch, width // patch)

    # --- generation ----------------------------------------------------------------------------------
    def _generate(
        self,
        request: GenerationRequest,
        input_ids: list[int],
        placed: list[_PromptImage],
        local_hashes: list[int],
        sequence_hashes: list[int],
        lease: PrefixLease,
        started: float,
        on_token: Callable[[str], None] | None,
        on_first_token: Callable[[], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> GenerationResult:
        import torch

        counters = _RequestCounters()
        with torch.inference_mode():
            # Stale state from the previous request must never leak in (trap 2); the explicit
            # positions below make it unused, the reset makes sure.
            if self.uses_mrope:
                self.model.model.rope_deltas = None
            logits, cache, reused, rope_delta = self._prefill(input_ids, placed, lease, request, counters)
            prefill_done = time.perf_counter()
            decoder = _Decoder(self, request, on_token)
            token = decoder.choose(logits)
            ttft = time.perf_counter()
            if on_first_token is not None:
                on_first_token()

            def store_prompt_blocks() -> None:
                if len(lease.blocks) < len(sequence_hashes):
                    self.kv_cache.store(lease, sequence_hashes, local_hashes, _cache_layers(cache))

            finish_reason = self._decode(
                decoder,
                token,
                cache,
                len(input_ids) + rope_delta,
                should_stop,
                request.max_tokens,
                after_first_token=store_prompt_blocks,
            )
        finished = time.perf_counter()
        return GenerationResult(
            text=decoder.text,
            finish_reason=finish_reason,
            prompt_tokens=len(input_ids),
            completion_tokens=decoder.completion_tokens,
            cached_tokens=reused,
            ttft_ms=(ttft - started) * 1000,
            prefill_ms=(prefill_done - started) * 1000,
            total_ms=(finished - started) * 1000,
            encoder_calls=counters.encoder_calls,
            embedding_cache_hits=counters.embedding_hits,
            embedding_cache_misses=counters.embedding_misses,
            block_hashes=sequence_hashes,
            embeddings_received=counters.embeddings_received,
            embedding_fallbacks=counters.embedding_fallbacks,
        )

    def _prefill(
        self,
        input_ids: list[int],
        placed: list[_PromptImage],
        lease: PrefixLease,
        request: GenerationRequest,
        counters: _RequestCounters,
    ) -> tuple[torch.Tensor, Any, int, int]:
        """Runs the model on the prompt past the reused prefix; returns the last logits, the KV
        cache of the whole prompt, the reused token count and the M-RoPE position delta (0 for 1-D)."""
        import torch
        from transformers import DynamicCache

        total = len(input_ids)
        # At least the last token runs: its logits choose the first output token.
        reused = min(lease.reused_blocks * self.block_size, total - 1)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        positions, rope_delta = self._positions(ids, placed)

        embeds = self.model.get_input_embeddings()(ids[:, reused:])
        for image in placed:
            end = image.start + image.length
            if end <= reused:
                continue  # wholly inside the reused prefix: neither preprocessed nor encoded
            embedding = self._image_embedding(image, request, counters)
            # An image cut by the prefix boundary contributes only its rows past it (trap 5).
            skip = max(0, reused - image.start)
            embeds[0, image.start + skip - reused : end - reused] = embedding[skip:].to(embeds.dtype)

        cache = None
        if reused:
            cache = DynamicCache([(k[:, :, :reused], v[:, :, :reused]) for k, v in prefix_kv(lease.blocks)])
        output = self.model(
            input_ids=None,
            inputs_embeds=embeds,
            # Positions of the whole prompt, sliced: never the 1-D fallback (traps 3 and 4).
            position_ids=positions[..., reused:],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[0, -1], output.cache, reused, rope_delta

    def _positions(self, ids: torch.Tensor, placed: list[_PromptImage]) -> tuple[torch.Tensor, int]:
        """The prompt's position ids, sequence last: (3, 1, n) M-RoPE for Qwen, (1, n) for LLaVA."""
        import torch

        if not self.uses_mrope:
            return torch.arange(ids.shape[1], device=self.device).unsqueeze(0), 0
        mm_token_type_ids = (ids == self.image_token_id).to(torch.int)
        grids = (
            torch.tensor([image.grid_thw for image in placed], dtype=torch.long, device=self.device)
            if placed
            else None
        )
        positions, deltas = self.model.model.get_rope_index(
            ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grids
        )
        return positions, int(deltas.reshape(-1)[0])

    def _image_embedding(
        self, image: _PromptImage, request: GenerationRequest, counters: _RequestCounters
    ) -> torch.Tensor:
        key = EmbeddingKey(
            request.scope_key, image.source.identity, self.model_name, self.processor_fingerprint
        )
        received = image.source.embedding
        if received is not None:
            if received.shape[0] == image.length:
                counters.embeddings_received += 1
                return received.to(self.device)
            # Features laid out for another prompt layout: never a failed request, encode here.
            logger.warning(
                "image %s: the encode worker sent %d feature rows for %d placeholders; encoding locally",
                image.source.identity,
                received.shape[0],
                image.length,
            )
            counters.embedding_fallbacks += 1
            if image.image is None and image.pixel_values is None:
                image.image = self._load_declared(image.source, request.scope_key)
        if request.use_embedding_cache:
            cached = self.embedding_cache.get(key)
            if cached is not None:
                counters.embedding_hits += 1
                return cached
            counters.embedding_misses += 1
        embedding = self._encode_image(image)
        counters.encoder_calls += 1
        if embedding.shape[0] != image.length:
            raise RuntimeError(
                f"the vision tower made {embedding.shape[0]} features for {image.length} placeholder tokens"
            )
        if request.use_embedding_cache:
            self.embedding_cache.put(key, embedding)
        return embedding

    def _encode_image(self, image: _PromptImage) -> torch.Tensor:
        """The image's features as the language model takes them: one row per placeholder token."""
        if self.vision_unloaded_from is not None:
            self.load_vision()
        if self.uses_mrope:
            pixel_values, grid_thw = self._image_pixels(image)
            output = self.model.model.get_image_features(
                pixel_values.to(self.device), grid_thw.to(self.device), return_dict=True
            )
            return output.pooler_output[0]
        pixels = self._llava_pixels(image)
        # The family's get_image_features selects the configured layer and strategy, projects, and
        # (LLaVA-NeXT) unpads the anyres grid and adds its newline features.
        output = self.model.model.get_image_features(
            **{name: tensor.to(self.device) for name, tensor in pixels.items()}, return_dict=True
        )
        return output.pooler_output[0]

    def _llava_pixels(self, image: _PromptImage) -> dict[str, torch.Tensor]:
        """pixel_values (and LLaVA-NeXT's image_sizes) of one image: the frontend's, else made here."""
        if image.pixel_values is not None:
            first, last = image.pixel_rows
            pixels = {"pixel_values": image.pixel_values[first:last]}
            if image.image_sizes is not None:
                pixels["image_sizes"] = image.image_sizes[first:last]
            return pixels
        features = self.image_processor(images=[image.image], return_tensors="pt")
        return {name: features[name] for name in ("pixel_values", "image_sizes") if name in features}

    def _image_pixels(self, image: _PromptImage) -> tuple[torch.Tensor, torch.Tensor]:
        """The image's patches and grid: the frontend's rows when it sent them, else preprocessed here."""
        import torch

        if image.pixel_values is not None:
            first, last = image.pixel_rows
            return image.pixel_values[first:last], torch.tensor([image.grid_thw], dtype=torch.long)
        features = self.image_processor(images=[image.image], return_tensors="pt")
        grid = tuple(int(n) for n in features["image_grid_thw"][0])
        if grid != image.grid_thw:
            raise RuntimeError(
                f"image processor made grid {grid}, the prompt was laid out for {image.grid_thw}"
            )
        return features["pixel_values"], features["image_grid_thw"]

    def _decode(
        self,
        decoder: _Decoder,
        token: int,
        cache: Any,
        next_position: int,
        should_stop: Callable[[], bool] | None,
        max_tokens: int,
        after_first_token: Callable[[], None],
    ) -> str:
        import torch

        # The prompt's blocks are stored once the first token's text is out (or generation ended):
        # storing copies KV and publishes events, which the client need not wait for.
        pending = after_first_token
        try:
            while True:
                if token in self._eos_ids:
                    decoder.finish()
                    return "stop"
                if decoder.accept(token):
                    return "stop"  # a stop string
                if pending is not None:
                    pending()
                    pending = None
                if decoder.completion_tokens >= max_tokens:
                    decoder.finish()
                    return "length"
                if should_stop is not None and should_stop():
                    decoder.finish()
                    return "stop"
                # Decode steps sit at text positions shifted by the prompt's M-RoPE delta, on all axes.
                shape = (3, 1, 1) if self.uses_mrope else (1, 1)
                position = torch.full(shape, next_position, dtype=torch.long, device=self.device)
                output = self.model(
                    input_ids=torch.tensor([[token]], device=self.device),
                    position_ids=position,
                    cache=cache,
                    use_cache=True,
                )
                cache = output.cache
                next_position += 1
                token = decoder.choose(output.logits[0, -1])
        finally:
            if pending is not None:
                pending()

    # --- model facts ---------------------------------------------------------------------------------
    def _end_of_sequence_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.model.config.text_config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        for token in ("<|im_end|>", "<|endoftext|>"):
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                ids.add(token_id)
        return frozenset(ids)

    def _fingerprint_image_processor(self) -> str:
        settings = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        return xxhash.xxh3_64_hexdigest(settings.encode())


class IncrementalDetokenizer:
    """Turns generated token ids into text pieces as they arrive.

    It decodes a short window of ids: a multi-byte character split across byte-level BPE pieces
    decodes to U+FFFD until its last piece arrives, and is only emitted then.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token: int) -> str:
        """Adds a token; returns the text it completes (often empty for a partial character)."""
        self.ids.append(token)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.ids))
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self.ids[start:end], skip_special_tokens=True)


class _Decoder:
    """Chooses tokens (greedy or seeded sampling) and turns them into text pieces, holding back
    text that could still become a stop string."""

    def __init__(
        self, engine: Engine, request: GenerationRequest, on_token: Callable[[str], None] | None
    ) -> None:
        import torch

        self._temperature = request.temperature
        self._top_p = request.top_p
        self._generator: torch.Generator | None = None
        if request.temperature > 0:
            self._generator = torch.Generator(device="cpu")
            seed = request.seed if request.seed is not None else secrets.randbits(63)
            self._generator.manual_seed(seed)
        self._stops = [stop for stop in request.stop if stop]
        self._on_token = on_token
        self._detokenizer = IncrementalDetokenizer(engine.tokenizer)
        self._text = ""  # decoded so far
        self._sent = 0  # characters of _text given to on_token
        self.text = ""  # the final text, set when finished

    @property
    def completion_tokens(self) -> int:
        return len(self._detokenizer.ids)

    def choose(self, logits: torch.Tensor) -> int:
        import torch

        if self._generator is None:
            return int(torch.argmax(logits))
        # On the CPU in float32, so a seed gives the same tokens whatever the device.
        scaled = logits.float().cpu() / self._temperature
        probabilities = torch.softmax(scaled, dim=-1)
        if self._top_p < 1.0:
            ordered, order = torch.sort(probabilities, descending=True)
            # Keep the smallest head whose mass reaches top_p (the first token always stays).
            outside = torch.cumsum(ordered, dim=-1) - ordered >= self._top_p
            ordered[outside] = 0.0
            probabilities = torch.zeros_like(probabilities).scatter_(0, order, ordered)
        return int(torch.multinomial(probabilities, 1, generator=self._generator))

    def accept(self, token: int) -> bool:
        """Adds a generated token; True when a stop string has ended the text."""
        self._text += self._detokenizer.push(token)
        return self._check_stops()

    def finish(self) -> None:
        """The end of generation: sends what was held back."""
        self._text += self._detokenizer.flush()
        if not self._check_stops():
            self._send(len(self._text))
            self.text = self._text

    def _check_stops(self) -> bool:
        for stop in self._stops:
            # Only a match reaching into unsent text is new; earlier text was already checked.
            found = self._text.find(stop, max(0, self._sent - len(stop) + 1))
            if found != -1:
                self._text = self._text[:found]
                self._send(len(self._text))
                self.text = self._text
                return True
        self._send(len(self._text) - self._held_back())
        return False

    def _held_back(self) -> int:
        """Length of the text's longest tail that starts some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _send(self, upto: int) -> None:
        if upto > self._sent:
            piece = self._text[self._sent : upto]
            self._sent = upto
            if self._on_token is not None:
                self._on_token(piece)


def _cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]
