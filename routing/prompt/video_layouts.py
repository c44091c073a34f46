"""How each video-capable model family samples a clip's frames and expands them into prompt tokens.

Pure arithmetic mirroring transformers' Qwen2-VL and Qwen3-VL video processors and processors
(the tests hold it to their own `sample_frames`, `smart_resize`, `get_num_of_video_patches` and
`replace_video_token`), so the frontend lays a video out from its frame count, size and rate
alone, without torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from routing.prompt.layouts import FAMILY_NAMES, QWEN_MAX_ASPECT_RATIO, qwen_smart_resize

QWEN_VIDEO_PLACEHOLDER = "<|video_pad|>"
QWEN_VISION_START = "<|vision_start|>"
QWEN_VISION_END = "<|vision_end|>"

# transformers' video processor class defaults (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor).
QWEN2_VL_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN2_VL_VIDEO_MAX_PIXELS = 28 * 28 * 768
QWEN3_VL_VIDEO_MIN_PIXELS = 128 * 32 * 32
QWEN3_VL_VIDEO_MAX_PIXELS = 32 * 32 * 768
# Qwen2-VL's processor samples nothing itself (do_sample_frames=False); the frames it was trained
# on come from qwen-vl-utils at 2 frames per second, 4 to 768 frames: the same rule as transformers'
# own Qwen2VLVideoProcessor.sample_frames given fps=2, which is what is applied here.
DEFAULT_VIDEO_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 768


class VideoRefused(ValueError):
    """The model family cannot take this clip (too few frames, a degenerate shape)."""


@dataclass(frozen=True)
class VideoExpansion:
    """A sampled clip as the prompt holds it: grid, placeholder tokens, and the text between them."""

    grid_thw: tuple[int, int, int]  # temporal patches, height and width in patches
    resized_height: int
    resized_width: int
    placeholder_tokens: int  # <|video_pad|> tokens in all
    tokens_per_group: int  # placeholder tokens per temporal patch
    # Qwen3-VL: the "<t seconds>" text before each temporal group; empty for Qwen2-VL.
    timestamps: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class QwenVideoLayout:
    """Qwen2-VL / Qwen2.5-VL (`timestamps=False`) and Qwen3-VL (`timestamps=True`)."""

    family: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    fps: float
    min_frames: int
    max_frames: int
    timestamps: bool
    placeholder_token: str = QWEN_VIDEO_PLACEHOLDER

    @property
    def name(self) -> str:
        return FAMILY_NAMES.get(self.family, self.family)

    # --- sampling ----------------------------------------------------------------------------------
    def sample_indices(self, total_frames: int, video_fps: float) -> list[int]:
        """The indices of the frames the family's video processor keeps, in order."""
        if total_frames < 1:
            raise VideoRefused("the video has no frames")
        if not video_fps or video_fps <= 0:
            raise VideoRefused("the video declares no frame rate")
        if self.timestamps:
            return self._sample_qwen3(total_frames, video_fps)
        return self._sample_qwen2(total_frames, video_fps)

    def _sample_qwen2(self, total: int, video_fps: float) -> list[int]:
        # Qwen2VLVideoProcessor.sample_frames with fps: the same operations in the same order.
        tps = self.temporal_patch_size
        max_frames = math.floor(min(self.max_frames, total) / tps) * tps
        num_frames = total / video_fps * self.fps
        num_frames = min(max(num_frames, self.min_frames), max_frames, total)
        num_frames = math.floor(num_frames / tps) * tps
        if num_frames < 1:
            raise VideoRefused(
                f"the video has {total} frames; {self.name} needs at least {tps} to sample from"
            )
        return _torch_float_arange_as_int(total, total / num_frames)

    def _sample_qwen3(self, total: int, video_fps: float) -> list[int]:
        # Qwen3VLVideoProcessor.sample_frames with fps.
        num_frames = int(total / video_fps * self.fps)
        num_frames = min(max(num_frames, self.min_frames), self.max_frames, total)
        indices = np.linspace(0, total - 1, num_frames).round().astype(int)
        return [int(i) for i in indices]

    # --- sizing ------------------------------------------------------------------------------------
    def resized_size(self, num_frames: int, width: int, height: int) -> tuple[int, int]:
        """(height, width) every sampled frame is resized to: the video processor's smart_resize."""
        if width < 1 or height < 1:
            raise VideoRefused(f"a frame of {width}x{height} has a side under 1 pixel")
        factor = self.patch_size * self.merge_size
        if self.timestamps:
            return self._smart_resize_qwen3(num_frames, height, width, factor)
        return self._smart_resize_qwen2(height, width, factor)

    def _check_ratio(self, height: int, width: int) -> None:
        ratio = max(height, width) / min(height, width)
        if ratio > QWEN_MAX_ASPECT_RATIO:
            raise VideoRefused(
                f"frames of {width}x{height} have an aspect ratio of {ratio:.4g}, over "
                f"{QWEN_MAX_ASPECT_RATIO}, which {self.name} refuses"
            )

    def _smart_resize_qwen2(self, height: int, width: int, factor: int) -> tuple[int, int]:
        self._check_ratio(height, width)
        return qwen_smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def _smart_resize_qwen3(self, num_frames: int, height: int, width: int, factor: int) -> tuple[int, int]:
        tps = self.temporal_patch_size
        if num_frames < tps:
            raise VideoRefused(f"{num_frames} sampled frames are fewer than the {tps} {self.name} needs")
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height = int(height * scale)
            width = int(width * scale)
        self._check_ratio(height, width)
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        t_bar = round(num_frames / tps) * tps
        if t_bar * h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((num_frames * height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif t_bar * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (num_frames * height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    # --- the prompt --------------------------------------------------------------------------------
    def timestamps_text(self, indices: list[int], video_fps: float) -> tuple[str, ...]:
        """Qwen3-VL's "<t seconds>" per temporal group: Qwen3VLProcessor._calculate_timestamps."""
        padded = list(indices)
        tps = self.temporal_patch_size
        if len(padded) % tps:
            padded.extend(padded[-1] for _ in range(tps - len(padded) % tps))
        seconds = [index / video_fps for index in padded]
        averaged = [(seconds[i] + seconds[i + tps - 1]) / 2 for i in range(0, len(seconds), tps)]
        return tuple(f"<{t:.1f} seconds>" for t in averaged)

    def expansion(self, indices: list[int], video_fps: float, width: int, height: int) -> VideoExpansion:
        """How the sampled frames (of `width`x`height`) enter the prompt."""
        num_frames = len(indices)
        if num_frames < 1:
            raise VideoRefused("no frames were sampled")
        resized_height, resized_width = self.resized_size(num_frames, width, height)
        grid_t = (num_frames + -num_frames % self.temporal_patch_size) // self.temporal_patch_size
        grid_h, grid_w = resized_height // self.patch_size, resized_width // self.patch_size
        per_group = grid_h * grid_w // (self.merge_size * self.merge_size)
        return VideoExpansion(
            grid_thw=(grid_t, grid_h, grid_w),
            resized_height=resized_height,
            resized_width=resized_width,
            placeholder_tokens=grid_t * per_group,
            tokens_per_group=per_group,
            timestamps=self.timestamps_text(indices, video_fps) if self.timestamps else (),
        )

    def settings(self) -> dict[str, Any]:
        """What identifies this sampling and sizing (folded into a video's identity)."""
        return {
            "family": self.family,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "fps": self.fps,
            "min_frames": self.min_frames,
            "max_frames": self.max_frames,
        }


_TORCH_ARANGE_LANES = 8


def _torch_float_arange_as_int(end: int, step: float) -> list[int]:
    """`torch.arange(0, end, step).int()` as torch's CPU kernel computes it (float32 output): the
    length in double; whole chunks of 8 as `float32(step·i0)` plus `j·step` in double, cast to
    float32; the tail one by one as `float32(step·i)`. Rounding differs by one frame now and then
    from a plain `i·step`, and the oracle tests see every such frame."""
    length = math.ceil(end / step)
    values = np.empty(length, dtype=np.float32)
    whole = length // _TORCH_ARANGE_LANES * _TORCH_ARANGE_LANES
    lanes = np.arange(_TORCH_ARANGE_LANES, dtype=np.float64) * step
    for first in range(0, whole, _TORCH_ARANGE_LANES):
        base = np.float64(np.float32(first * step))
        values[first : first + _TORCH_ARANGE_LANES] = (base + lanes).astype(np.float32)
    for index in range(whole, length):
        values[index] = np.float32(index * step)
    return [int(v) for v in values]


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _positive_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _qwen_video_builder(
    patch_size: int, min_pixels: int, max_pixels: int, *, timestamps: bool
) -> Callable[[str, Mapping[str, Any]], QwenVideoLayout | None]:
    def build(family: str, video: Mapping[str, Any]) -> QwenVideoLayout | None:
        if video.get("cap_pixels_per_frame"):
            # The per-frame cap is not mirrored here: such a model takes no video rather than
            # a video counted differently from its processor.
            return None
        size = video.get("size") or {}
        low = video.get("min_pixels") or size.get("shortest_edge") or min_pixels
        high = video.get("max_pixels") or size.get("longest_edge") or max_pixels
        fps = video.get("fps")
        return QwenVideoLayout(
            family=family,
            patch_size=_positive_int(video.get("patch_size", patch_size), "patch_size"),
            merge_size=_positive_int(video.get("merge_size", 2), "merge_size"),
            temporal_patch_size=_positive_int(video.get("temporal_patch_size", 2), "temporal_patch_size"),
            min_pixels=_positive_int(low, "min_pixels"),
            max_pixels=_positive_int(high, "max_pixels"),
            fps=_positive_number(fps if fps is not None else DEFAULT_VIDEO_FPS, "fps"),
            min_frames=_positive_int(video.get("min_frames", DEFAULT_MIN_FRAMES), "min_frames"),
            max_frames=_positive_int(video.get("max_frames", DEFAULT_MAX_FRAMES), "max_frames"),
            timestamps=timestamps,
        )

    return build


_FAMILIES: dict[str, Callable[[str, Mapping[str, Any]], QwenVideoLayout | None]] = {
    "qwen2_vl": _qwen_video_builder(
        14, QWEN2_VL_VIDEO_MIN_PIXELS, QWEN2_VL_VIDEO_MAX_PIXELS, timestamps=False
    ),
    "qwen2_5_vl": _qwen_video_builder(
        14, QWEN2_VL_VIDEO_MIN_PIXELS, QWEN2_VL_VIDEO_MAX_PIXELS, timestamps=False
    ),
    "qwen3_vl": _qwen_video_builder(
        16, QWEN3_VL_VIDEO_MIN_PIXELS, QWEN3_VL_VIDEO_MAX_PIXELS, timestamps=True
    ),
    "qwen3_vl_moe": _qwen_video_builder(
        16, QWEN3_VL_VIDEO_MIN_PIXELS, QWEN3_VL_VIDEO_MAX_PIXELS, timestamps=True
    ),
}

VIDEO_FAMILIES = frozenset(_FAMILIES)


def video_layout_for_config(
    config: Mapping[str, Any], video_preprocessor: Mapping[str, Any] | None
) -> QwenVideoLayout | None:
    """The video layout of a checkpoint (its config.json and video processor settings); None for a
    family that takes no video here."""
    build = _FAMILIES.get(str(config.get("model_type", "")))
    if build is None:
        return None
    return build(str(config["model_type"]), dict(video_preprocessor or {}))


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def video_layout_for_model_dir(path: Path) -> QwenVideoLayout | None:
    """The video layout of a local checkpoint: `video_preprocessor_config.json`, else the
    `video_processor` section of processor_config.json, else the class defaults."""
    path = Path(path)
    config = _read_json(path / "config.json")
    if config is None:
        raise FileNotFoundError(f"{path} has no config.json")
    video = _read_json(path / "video_preprocessor_config.json")
    if video is None:
        nested = (_read_json(path / "processor_config.json") or {}).get("video_processor")
        video = nested if isinstance(nested, dict) else {}
    return video_layout_for_config(config, video)


def video_expansion_ids(
    expansion: VideoExpansion,
    encode: Callable[[str], list[int]],
    *,
    placeholder_id: int,
    vision_start_id: int | None,
    vision_end_id: int | None,
) -> list[int]:
    """The token ids a video's one placeholder becomes. Qwen3-VL: per temporal group its timestamp
    text, then the group's placeholders between vision markers (special tokens split the text
    before BPE, so the timestamp tokenizes alone exactly as inside the whole prompt)."""
    if not expansion.timestamps:
        return [placeholder_id] * expansion.placeholder_tokens
    if vision_start_id is None or vision_end_id is None:
        raise ValueError("the tokenizer has no <|vision_start|>/<|vision_end|> tokens")
    ids: list[int] = []
    for stamp in expansion.timestamps:
        ids.extend(encode(stamp))
        ids.append(vision_start_id)
        ids.extend([placeholder_id] * expansion.tokens_per_group)
        ids.append(vision_end_id)
    return ids
