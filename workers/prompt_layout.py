"""A prompt as the model sees it: token ids with each image placeholder expanded to the image's
token count, and where each image's tokens are. Counts come from image sizes alone, so an image
the cached prefix covers is never loaded or preprocessed (ENGINE-NOTES trap 7). No model needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

if TYPE_CHECKING:
    import torch

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
class DeclaredSize:
    width: int
    height: int


@dataclass
class PromptImage:
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

    @property
    def end(self) -> int:
        return self.start + self.length


class PromptLayout:
    """Lays out chat-templated prompts for one model's tokenizer and image processor."""

    def __init__(self, processor: Any, *, image_token_id: int, model_type: str) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.image_token: str = processor.image_token
        self.image_token_id = image_token_id
        self.model_type = model_type
        # LLaVA runs the text model on 1-D positions; Qwen's M-RoPE needs the image grids.
        self.uses_mrope = model_type not in LLAVA_MODEL_TYPES

    def expand(
        self, prompt: str, inputs: Sequence[ImageInput], images: Sequence[Image.Image | DeclaredSize]
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt's ids with each placeholder expanded, and the images' spans."""
        parts = prompt.split(self.image_token)
        if len(parts) - 1 != len(images):
            raise PromptError(f"the prompt has {len(parts) - 1} image placeholders for {len(images)} images")
        if "<|video_pad|>" in prompt:
            raise PromptError("video inputs are not supported by this engine")
        ids: list[int] = []
        placed: list[PromptImage] = []
        for index, part in enumerate(parts):
            # Special tokens split the text before BPE runs, so tokenizing between them is exact.
            ids.extend(self.tokenizer(part, add_special_tokens=False)["input_ids"])
            if index < len(images):
                length, grid = self.image_tokens(images[index])
                image = images[index]
                loaded = image if isinstance(image, Image.Image) else None
                placed.append(PromptImage(inputs[index], len(ids), length, grid, image=loaded))
                ids.extend([self.image_token_id] * length)
        return ids, placed

    def image_tokens(self, image: Image.Image | DeclaredSize) -> tuple[int, tuple[int, int, int] | None]:
        """Placeholder tokens of an image (and Qwen's patch grid), from its size alone."""
        if self.uses_mrope:
            grid = self.image_grid(image)
            return grid[0] * grid[1] * grid[2] // self.image_processor.merge_size**2, grid
        # The processor's own size-only count (the hook vLLM uses; no pixels, so an image inside the
        # reused prefix is never preprocessed): LLaVA-1.5's fixed tile, LLaVA-NeXT's anyres grid.
        counts = self.processor._get_num_multimodal_tokens(image_sizes=[(image.height, image.width)])
        return int(counts["num_image_tokens"][0]), None

    def image_grid(self, image: Image.Image | DeclaredSize) -> tuple[int, int, int]:
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
