"""The native engine's input processing: a `GenerationRequest` becomes a scheduler sequence.

Validates the request, lays the prompt out (`workers.prompt_layout`, or checks the frontend
processor's inputs with `workers.processed_inputs`), hashes its blocks as the router does, looks
at the prefix cache, and loads only the images the cached prefix does not cover. Runs in the
caller's thread, outside the model's.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PIL import Image

from routing.media.images import (
    MediaPolicy,
    decode_data_url,
    decode_image,
    fetch_bytes,
    is_data_url,
    routing_hash,
)
from routing.prompt.hashing import MediaPlacement, chain_sequence_hashes, local_block_hashes
from workers.detokenizer import TextStream
from workers.embedding_cache import EmbeddingCache, EmbeddingKey
from workers.engine.api import GenerationRequest
from workers.kv_cache import KvPool
from workers.processed_inputs import processed_prompt
from workers.prompt_layout import (
    ContextLengthExceeded,
    DeclaredSize,
    ImageChangedError,
    ImageInput,
    PromptError,
    PromptImage,
    PromptLayout,
    VideoInput,
    stored_frames,
)
from workers.sampler import RequestSampler, SamplingParams
from workers.scheduler import SequenceState, fits

if TYPE_CHECKING:
    import torch

    from workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)

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


@dataclass(eq=False)
class RequestState:
    """What the engine keeps with a request while it runs (a `SequenceState`'s payload)."""

    request: GenerationRequest
    placed: list[PromptImage]
    sampler: RequestSampler
    events: queue.SimpleQueue
    submitted_at: float
    stream: TextStream = field(init=False)
    # With `logprobs`: OpenAI's entries of the tokens streamed so far, in order.
    logprob_entries: list[dict[str, Any]] = field(default_factory=list)
    mrope: torch.Tensor | None = None
    rope_delta: int = 0
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    first_token_at: float | None = None
    encoder_calls: int = 0
    embedding_hits: int = 0
    embedding_misses: int = 0
    embeddings_received: int = 0
    embedding_fallbacks: int = 0
    # E/PD: set once the encode workers' features arrived (or never will); until then the request
    # is held out of the scheduler while the engine encodes its other images ahead.
    features_gate: threading.Event | None = None
    covered_at_submit: int = 0  # prompt tokens the cached prefix covered at submission
    tokens_streamed: int = 0  # generated tokens the pieces sent so far carried
    encoded_ahead: bool = False  # its locally encoded images are done (or were tried)


class InputProcessor:
    """Turns requests into sequences the scheduler runs; loads the images they lack."""

    def __init__(
        self,
        *,
        layout: PromptLayout,
        runner: ModelRunner,
        kv_pool: KvPool,
        embedding_cache: EmbeddingCache,
        load_image: ImageLoader,
        model_name: str,
        video_fingerprint: str,
        vocab_size: int,
        video_token_id: int | None,
    ) -> None:
        self.layout = layout
        self.runner = runner
        self.kv_pool = kv_pool
        self.block_size = kv_pool.block_size
        self.embedding_cache = embedding_cache
        self.load_image = load_image
        self.model_name = model_name
        self.video_fingerprint = video_fingerprint
        self.vocab_size = vocab_size
        self.video_token_id = video_token_id

    def process(self, request: GenerationRequest, submitted_at: float) -> SequenceState:
        """The request's sequence, its `RequestState` as payload (without its text stream, which
        the output processor attaches). Bad requests raise PromptError."""
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int):
            raise PromptError("max_tokens must be an integer")
        if request.max_tokens < 1:
            raise PromptError("max_tokens must be >= 1")
        params = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=tuple(sorted(request.logit_bias.items())),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
        )
        input_ids, placed = self.prompt(request)
        if request.continued_token_ids:
            # A continued answer: its earlier tokens are prompt here, computed in one prefill.
            input_ids = [*input_ids, *request.continued_token_ids]
        if not fits(self.kv_pool, len(input_ids), request.max_tokens):
            # The client hears the limit in tokens; the operator's log names the setting.
            logger.info(
                "request %s: %d prompt tokens + max_tokens %d exceed the KV pool of %d blocks "
                "(KV_CAPACITY_BLOCKS)",
                request.request_id,
                len(input_ids),
                request.max_tokens,
                self.kv_pool.capacity_blocks,
            )
            raise ContextLengthExceeded(
                self.kv_pool.capacity_blocks * self.block_size, len(input_ids), request.max_tokens
            )
        media = [MediaPlacement(routing_hash(p.source.identity), p.start, p.length) for p in placed]
        local_hashes = local_block_hashes(input_ids, self.block_size, media)
        sequence_hashes = chain_sequence_hashes(local_hashes, request.cache_salt)
        # A look, not a hold: pinning blocks while waiting would keep them from eviction. If they
        # are evicted before the request runs, the engine loads what it then lacks.
        cached = self.kv_pool.cached_prefix_blocks(sequence_hashes)
        usable = min(cached, (len(input_ids) - 1) // self.block_size)
        self._load_uncovered(
            placed, usable * self.block_size, request.scope_key, cached_embeddings=request.use_embedding_cache
        )
        sampler = RequestSampler(params)
        for token in request.continued_token_ids:
            # A continued answer's penalties count the tokens the first worker generated, too.
            sampler.counts[token] = sampler.counts.get(token, 0) + 1
        state = RequestState(
            request=request,
            placed=placed,
            sampler=sampler,
            events=queue.SimpleQueue(),
            submitted_at=submitted_at,
            covered_at_submit=usable * self.block_size,
        )
        if any(image.features_expected for image in request.images):
            state.features_gate = threading.Event()
        if self.layout.uses_mrope:
            state.mrope, state.rope_delta = self.runner.rope_positions(input_ids, placed)
        return SequenceState(
            request_id=request.request_id,
            tokens=list(input_ids),
            prompt_len=len(input_ids),
            max_tokens=request.max_tokens,
            sequence_hashes=sequence_hashes,
            local_hashes=local_hashes,
            payload=state,
            priority=request.priority,
        )

    def prompt(self, request: GenerationRequest) -> tuple[list[int], list[PromptImage]]:
        """The input ids and image spans; images are loaded here only if their size is unknown."""
        if request.processed is not None:
            return processed_prompt(
                self.layout,
                request.images,
                request.processed,
                vocab_size=self.vocab_size,
                video_token_id=self.video_token_id,
            )
        if all(image.width and image.height for image in request.images):
            sizes = [DeclaredSize(int(image.width), int(image.height)) for image in request.images]  # type: ignore[arg-type]
            return self.layout.expand(request.prompt, request.images, sizes, request.videos)
        loaded = [self.load_image(image, request.scope_key) for image in request.images]
        return self.layout.expand(request.prompt, request.images, loaded, request.videos)

    def _load_uncovered(
        self,
        placed: list[PromptImage],
        reused: int,
        scope_key: str | None,
        *,
        cached_embeddings: bool = False,
    ) -> None:
        for image in placed:
            if image.kind == "video":
                if image.frames is None and image.end > reused:
                    # A video whose embedding is cached needs no frames (a look, not a use).
                    key = EmbeddingKey(
                        scope_key, image.source.identity, self.model_name, self.video_fingerprint
                    )
                    if not (cached_embeddings and key in self.embedding_cache):
                        image.frames = self.load_frames(image.source)  # type: ignore[arg-type]
                continue
            if image.encoded_elsewhere:
                continue  # E/PD: loaded later only if the encode worker's features fail
            if image.image is None and image.pixel_values is None and image.end > reused:
                image.image = self.load_declared(image.source, scope_key)

    def load_frames(self, video: VideoInput) -> bytes:
        """A video's sampled frames, from where the frontend left them (never the origin)."""
        return stored_frames(video)

    def load_declared(self, source: ImageInput, scope_key: str | None) -> Image.Image:
        """An image laid out from its declared size, loaded now; it must still have that size."""
        image = self.load_image(source, scope_key)
        # A loader may decode a large image reduced to the processor's size: its source size counts.
        if image.info.get("source_size", image.size) != (source.width, source.height):
            raise ImageChangedError(
                f"image {source.identity} is {image.width}x{image.height} now but was "
                f"{source.width}x{source.height} when the request was routed: it changed at its origin"
            )
        return image
