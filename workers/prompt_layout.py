"""A prompt as the model sees it: token ids with each image placeholder expanded to the image's
token count, and where each image's tokens are. Counts come from image sizes alone, so an image
the cached prefix covers is never loaded or preprocessed (ENGINE-NOTES trap 7). No model needed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from routing.contract.tasks import CONTEXT_LENGTH_EXCEEDED, IMAGE_CHANGED, context_length_message

if TYPE_CHECKING:
    import torch

    from workers.video_inputs import VideoPreprocessor

# Families whose images are fixed tiles of a CLIP-like tower and whose positions are 1-D (no M-RoPE).
LLAVA_MODEL_TYPES = frozenset({"llava", "llava_next"})


class PromptError(ValueError):
    """A request the engine cannot run as sent; `status` is what the API answers with."""

    status = 400
    code = "invalid_prompt"


class ContextLengthExceeded(PromptError):
    """A prompt and completion this worker's KV pool can never hold: OpenAI's code and words,
    in tokens, as the frontend answers it when it sees the limit first."""

    code = CONTEXT_LENGTH_EXCEEDED
    param = "messages"

    def __init__(self, limit: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(context_length_message(limit, prompt_tokens, max_tokens))


class ImageChangedError(PromptError):
    """A picture whose size at its origin is no longer the one its request was routed with: the
    request was sound when sent, the picture changed since (409; sent again, it is read afresh)."""

    status = 409
    code = IMAGE_CHANGED


@dataclass
class ImageInput:
    identity: str  # 32-hex identity from the frontend
    url: str | None = None
    index: int | None = None  # place among the request's images, named in a refusal ("image 0: ...")
    data: bytes | None = None  # encoded bytes handed over when frontend decoding is on
    # The size the frontend read from the image's header. With it, the prompt is laid out before
    # any image is loaded, and an image inside the cached prefix is never fetched at all.
    width: int | None = None
    height: int | None = None
    # E/PD: the image's features from an encode worker (workers.embedding_transfer), already
    # checked against their checksum. Used instead of the vision tower when their row count fits
    # the image's placeholder tokens; otherwise the engine encodes the image itself (a fallback).
    embedding: torch.Tensor | None = None
    # E/PD: an encode worker computes this image's features. The engine neither loads nor encodes
    # it while they are awaited (`RequestHandle.features_arrived`); if they never come, it does.
    features_expected: bool = False


@dataclass
class VideoInput:
    """A video as the frontend decoded and sampled it (routing.contract.tasks.VideoRef): laid out from
    these facts; its frames are read (from the media side store) only if the prefix misses it."""

    identity: str  # hash of the sampled, decoded frames
    fps: float
    total_frames: int
    indices: tuple[int, ...]
    width: int
    height: int
    grid_thw: tuple[int, int, int]
    frame_shape: tuple[int, int, int, int]  # frames, height, width, 3 (resized for the model)
    load_frames: Callable[[], bytes] | None = None
    embedding: None = None  # videos are always encoded where they are served (no E/PD transfer)


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
    # A video: `source` is a VideoInput, `frames` its sampled frames once loaded, and (Qwen3-VL,
    # whose timestamps sit between its frame groups) the prompt positions of its placeholders.
    kind: str = "image"
    frames: bytes | None = None
    pad_positions: tuple[int, ...] | None = None

    @property
    def encoded_elsewhere(self) -> bool:
        """E/PD: whether an encode worker's features take the place of this image's pixels and
        encoder here: they are on their way, or came with a row for each placeholder. Never for a
        video (encode workers take pictures only, and a VideoInput has neither field)."""
        if self.kind == "video":
            return False
        source = self.source
        received = source.embedding
        return source.features_expected or (received is not None and received.shape[0] == self.length)

    def placeholder_rows(self, first: int, last: int) -> list[tuple[int, int, int]]:
        """(prompt position, first feature row, rows) of each run of this media's placeholders
        within prompt positions [first, last)."""
        if self.pad_positions is None:
            low, high = max(first, self.start), min(last, self.end)
            return [(low, low - self.start, high - low)] if low < high else []
        runs: list[tuple[int, int, int]] = []
        for row, position in enumerate(self.pad_positions):
            if first <= position < last:
                if runs and runs[-1][0] + runs[-1][2] == position:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((position, row, 1))
        return runs

    @property
    def end(self) -> int:
        return self.start + self.length


class PromptLayout:
    """Lays out chat-templated prompts for one model's tokenizer and image processor."""

    def __init__(
        self,
        processor: Any,
        *,
        image_token_id: int,
        model_type: str,
        video: VideoPreprocessor | None = None,
        video_token_id: int | None = None,
    ) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.image_token: str = processor.image_token
        self.image_token_id = image_token_id
        self.model_type = model_type
        # LLaVA runs the text model on 1-D positions; Qwen's M-RoPE needs the image grids.
        self.uses_mrope = model_type not in LLAVA_MODEL_TYPES
        self.video = video  # None: this model takes no video
        self.video_token = "<|video_pad|>"
        self.video_token_id = video_token_id

    def expand(
        self,
        prompt: str,
        inputs: Sequence[ImageInput],
        images: Sequence[Image.Image | DeclaredSize],
        videos: Sequence[VideoInput] = (),
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt's ids with each placeholder expanded, and the spans of its images and videos
        (in prompt order)."""
        parts = re.split(f"({re.escape(self.image_token)}|{re.escape(self.video_token)})", prompt)
        markers = parts[1::2]
        image_count = sum(1 for marker in markers if marker == self.image_token)
        if image_count != len(images):
            raise PromptError(f"the prompt has {image_count} image placeholders for {len(images)} images")
        if len(markers) - image_count != len(videos):
            raise PromptError(
                f"the prompt has {len(markers) - image_count} video placeholders for {len(videos)} videos"
            )
        if videos and (self.video is None or self.video_token_id is None):
            raise PromptError("this model takes no video input")
        ids: list[int] = []
        placed: list[PromptImage] = []
        next_image, next_video = 0, 0
        for index, part in enumerate(parts):
            if index % 2 == 0:
                # Special tokens split the text before BPE runs, so tokenizing between them is exact.
                ids.extend(self.tokenizer(part, add_special_tokens=False)["input_ids"])
            elif part == self.image_token:
                image = images[next_image]
                length, grid = self.image_tokens(image)
                loaded = image if isinstance(image, Image.Image) else None
                placed.append(PromptImage(inputs[next_image], len(ids), length, grid, image=loaded))
                ids.extend([self.image_token_id] * length)
                next_image += 1
            else:
                placed.append(self._place_video(videos[next_video], ids))
                next_video += 1
        return ids, placed

    def _place_video(self, video: VideoInput, ids: list[int]) -> PromptImage:
        """Appends the video's run (as the frontend laid it out) to `ids`; its span."""
        assert self.video is not None and self.video_token_id is not None
        run = video_run(self.video, self.tokenizer, video, self.video_token_id)
        start = len(ids)
        pads = tuple(start + n for n, token in enumerate(run) if token == self.video_token_id)
        ids.extend(run)
        return PromptImage(
            video,  # type: ignore[arg-type]
            start,
            len(run),
            tuple(video.grid_thw),  # type: ignore[arg-type]
            kind="video",
            pad_positions=None if len(pads) == len(run) else pads,
        )

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


def stored_frames(video: VideoInput) -> bytes:
    """A video's sampled frames, from where the frontend left them (never the origin), checked
    against the shape the task says they have."""
    if video.load_frames is None:
        raise PromptError(f"video {video.identity} came without its frames")
    frames = video.load_frames()
    count, height, width, channels = video.frame_shape
    if len(frames) != count * height * width * channels:
        raise PromptError(f"video {video.identity}: its stored frames are not {tuple(video.frame_shape)}")
    return frames


def video_run(preprocessor: Any, tokenizer: Any, video: VideoInput, placeholder_id: int) -> list[int]:
    """The token run a task's video placeholder becomes, laid out by this worker (its model's
    `workers.video_inputs.VideoPreprocessor` and tokenizer) as the frontend laid it out; a task
    whose grid this worker's layout disagrees with is a PromptError, not run."""
    from workers.video_inputs import VideoInputError, video_prompt_ids

    try:
        return video_prompt_ids(
            preprocessor,
            lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
            fps=video.fps,
            indices=tuple(video.indices),
            width=video.width,
            height=video.height,
            grid_thw=tuple(video.grid_thw),  # type: ignore[arg-type]
            placeholder_id=placeholder_id,
            vision_start_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        )
    except (VideoInputError, ValueError) as exc:
        raise PromptError(f"video {video.identity}: {exc}") from exc
