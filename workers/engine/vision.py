"""The native engine's vision stage: image and video embeddings for the prompts it runs.

An embedding comes from an encode worker (E/PD), the embedding cache, or the vision tower, in
that order. Images are encoded between steps, one per loop turn, so a step is a forward pass and
a request arriving during an encode can go first. An `llm` worker drops its tower after loading
and reads it back from the checkpoint on the first fallback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.embedding_cache import EmbeddingCache, EmbeddingKey
from workers.engine.counters import EngineCounters
from workers.engine.inputs import InputProcessor, RequestState
from workers.prompt_layout import PromptImage
from workers.scheduler import Scheduler, SequenceState

if TYPE_CHECKING:
    import torch

    from workers.model_runner import ModelRunner

logger = logging.getLogger("workers.engine")


class VisionStage:
    """Embeddings per request and image, from wherever is cheapest; the tower's unload and reload."""

    def __init__(
        self,
        *,
        model: Any,
        model_type: str,
        device: str,
        runner: ModelRunner,
        inputs: InputProcessor,
        embedding_cache: EmbeddingCache,
        model_name: str,
        processor_fingerprint: str,
        video_fingerprint: str,
        counters: EngineCounters,
    ) -> None:
        self.model = model
        self.model_type = model_type
        self.device = device
        self.runner = runner
        self.inputs = inputs
        self.embedding_cache = embedding_cache
        self.model_name = model_name
        self.processor_fingerprint = processor_fingerprint
        self.video_fingerprint = video_fingerprint
        self.counters = counters
        # An `llm` worker drops the vision tower after loading (encode workers compute its images'
        # features); it is read back from this checkpoint on the first fallback.
        self.unloaded_from: Path | None = None
        self.on_loaded: Callable[[Any], None] | None = None  # gets the tower (hooks)

    def image_embedding(self, state: RequestState, index: int) -> torch.Tensor:
        embedding = state.embeddings.get(index)
        if embedding is not None:
            return embedding
        request, image = state.request, state.placed[index]
        fingerprint = self.video_fingerprint if image.kind == "video" else self.processor_fingerprint
        key = EmbeddingKey(request.scope_key, image.source.identity, self.model_name, fingerprint)
        received = image.source.embedding
        if received is not None:
            if received.shape[0] == image.length:
                state.embeddings_received += 1
                state.embeddings[index] = received.to(self.runner.device)
                return state.embeddings[index]
            # Features laid out for another prompt layout: never a failed request, encode here.
            logger.warning(
                "image %s: the encode worker sent %d feature rows for %d placeholders; encoding locally",
                image.source.identity,
                received.shape[0],
                image.length,
            )
            state.embedding_fallbacks += 1
        if request.use_embedding_cache:
            embedding = self.embedding_cache.get(key)
            if embedding is not None:
                state.embedding_hits += 1
            else:
                state.embedding_misses += 1
        if embedding is None:
            if image.kind == "video":
                if image.frames is None:  # the prefix that covered it was evicted meanwhile
                    image.frames = self.inputs.load_frames(image.source)  # type: ignore[arg-type]
            elif image.image is None and image.pixel_values is None:
                # The prefix that covered it at submission was evicted before the request ran.
                image.image = self.inputs.load_declared(image.source, request.scope_key)
            if self.unloaded_from is not None:
                self.load_tower()
            embedding = self.runner.encode_image(image)
            state.encoder_calls += 1
            if request.use_embedding_cache:
                self.embedding_cache.put(key, embedding)
        state.embeddings[index] = embedding
        return embedding

    def encode_ahead(self, staged: list[SequenceState]) -> bool:
        """E/PD: encodes one image of a request awaiting an encode worker's features, of those
        this worker keeps, while the features travel. Returns whether it encoded anything.

        One image per loop turn, between steps: the running requests' decode steps keep going.
        Best effort: an image that fails here fails again, and is reported, when its chunk runs."""
        for sequence in staged:
            state: RequestState = sequence.payload
            if state.encoded_ahead or sequence.cancelled:
                continue
            for index, image in enumerate(state.placed):
                if index in state.embeddings or image.end <= state.covered_at_submit:
                    continue
                if image.encoded_elsewhere or not self.loaded(image):
                    continue
                try:
                    self.image_embedding(state, index)
                except Exception:
                    logger.debug("encoding ahead failed for %s", sequence.request_id, exc_info=True)
                    break
                return True
            state.encoded_ahead = True
        return False

    def encode_next_prompt(
        self, scheduler: Scheduler, fail: Callable[[SequenceState, Exception], None]
    ) -> bool:
        """Encodes, between steps, one image of the next prompt to compute (the scheduler's first)
        that its next chunk needs. Returns whether it encoded anything.

        The step that then computes the chunk is its forward pass alone, and a shorter request
        that arrives while the encoder runs goes first: in a step, it would have waited for the
        encoder and the longer prompt's whole chunk. An image that fails fails its request here,
        as it would in the step."""
        order = scheduler.prefill_order()
        if not order:
            return False
        sequence = order[0]
        if sequence.cancelled:
            return False
        state: RequestState = sequence.payload
        start = len(sequence.tokens) - scheduler.prefill_left(sequence)
        end = min(start + scheduler.max_batch_tokens, sequence.prompt_len)
        for index, image in enumerate(state.placed):
            if index in state.embeddings or image.end <= start or image.start >= end:
                continue
            if image.encoded_elsewhere:
                continue  # the step takes the encode worker's features (or falls back)
            started = time.perf_counter()
            try:
                self.image_embedding(state, index)
            except Exception as exc:
                fail(sequence, exc)
            self.counters.encoder_seconds += time.perf_counter() - started
            return True
        return False

    @staticmethod
    def loaded(image: PromptImage) -> bool:
        if image.kind == "video":
            return image.frames is not None
        return image.image is not None or image.pixel_values is not None

    def unload_tower(self, model_dir: Path) -> None:
        """Frees the vision tower and projector (`run_worker --role llm`), before serving."""
        import torch

        from workers.vision_encoder import VISION_PARTS

        for part in VISION_PARTS[self.model_type]:
            module = getattr(self.model.model, part)
            if isinstance(module, torch.nn.Parameter):
                setattr(self.model.model, part, torch.nn.Parameter(module.to("meta"), requires_grad=False))
            else:
                module.to("meta")
        self.unloaded_from = Path(model_dir)

    def load_tower(self) -> None:
        """Reads the vision parts back from the checkpoint (an `llm` worker's first fallback)."""
        from workers.vision_encoder import load_vision_parts, vision_tower

        if self.unloaded_from is None:
            return
        logger.warning("loading the vision tower back from %s to encode locally", self.unloaded_from)
        dtype = next(self.model.model.language_model.parameters()).dtype
        load_vision_parts(self.model.model, self.unloaded_from, device=str(self.device), dtype=dtype)
        self.unloaded_from = None
        if self.on_loaded is not None:
            self.on_loaded(vision_tower(self.model.model, self.model_type))
