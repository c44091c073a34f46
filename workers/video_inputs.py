"""A video's model inputs on the worker: the frontend's sampled frames (already resized for the model)
read from the frame store, rescaled, normalised and cut into the vision tower's patches exactly as
transformers' Qwen video processors do after their resize. The worker never fetches or decodes a
video: the frontend did, and its identity is a hash of these frames.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from routing.prompt.video_layouts import QwenVideoLayout, video_expansion_ids, video_layout_for_model_dir

if TYPE_CHECKING:
    import torch

# transformers' defaults when the video processor's config does not say (OPENAI_CLIP_MEAN/STD:
# Qwen2-VL's; Qwen3-VL's published configs say 0.5).
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)


class VideoInputError(ValueError):
    """A video the worker cannot take as sent (frames missing or not what the task says)."""

    status = 400
    code = "invalid_video"


@dataclass(frozen=True)
class VideoPreprocessor:
    """The model's video layout (sampling, sizing) and its pixel normalisation."""

    layout: QwenVideoLayout
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float

    @classmethod
    def for_model_dir(cls, path: Path) -> VideoPreprocessor | None:
        """None when the checkpoint's family takes no video."""
        layout = video_layout_for_model_dir(path)
        if layout is None:
            return None
        settings_path = Path(path) / "video_preprocessor_config.json"
        settings: dict[str, Any] = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
        default_mean, default_std = (_HALF, _HALF) if layout.timestamps else (_CLIP_MEAN, _CLIP_STD)
        return cls(
            layout=layout,
            mean=tuple(float(v) for v in settings.get("image_mean", default_mean)),  # type: ignore[arg-type]
            std=tuple(float(v) for v in settings.get("image_std", default_std)),  # type: ignore[arg-type]
            rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
        )

    @property
    def fingerprint(self) -> str:
        """What the video embeddings depend on besides the frames (part of their cache key)."""
        return json.dumps(
            {**self.layout.settings(), "mean": self.mean, "std": self.std, "rescale": self.rescale_factor},
            sort_keys=True,
        )

    def pixel_values(self, frames: bytes, frame_shape: tuple[int, int, int, int]) -> torch.Tensor:
        """(patches, channels · temporal · patch²) as the video processor's `pixel_values_videos`."""
        import numpy as np
        import torch

        count, height, width, channels = frame_shape
        if channels != 3 or len(frames) != count * height * width * channels:
            raise VideoInputError(
                f"the stored frames hold {len(frames)} bytes, not {count}x{height}x{width}x{channels}"
            )
        array = np.frombuffer(frames, dtype=np.uint8).reshape(count, height, width, channels)
        video = torch.from_numpy(array.copy()).permute(0, 3, 1, 2).to(torch.float32)  # T, C, H, W
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, 3, 1, 1)
        video = (video * self.rescale_factor - mean) / std
        return patchify(video.unsqueeze(0), self.layout)[0]


def patchify(videos: torch.Tensor, layout: QwenVideoLayout) -> torch.Tensor:
    """transformers' Qwen video `patchify`: (batch, T, C, H, W) to (batch, patches, patch dim), the
    last frame repeated up to a whole temporal patch."""
    import torch

    batch, frames, channels, height, width = videos.shape
    patch, merge, temporal = layout.patch_size, layout.merge_size, layout.temporal_patch_size
    if pad := -frames % temporal:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        frames += pad
    grid_t, grid_h, grid_w = frames // temporal, height // patch, width // patch
    patches = videos.reshape(
        batch, grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
    )
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(batch, grid_t * grid_h * grid_w, channels * temporal * patch * patch)


def video_prompt_ids(
    preprocessor: VideoPreprocessor,
    encode: Callable[[str], list[int]],
    *,
    fps: float,
    indices: tuple[int, ...],
    width: int,
    height: int,
    grid_thw: tuple[int, int, int],
    placeholder_id: int,
    vision_start_id: int | None,
    vision_end_id: int | None,
) -> list[int]:
    """The token run a video's placeholder becomes, laid out here as the frontend laid it out; a
    task whose grid disagrees with this worker's layout is refused, not run."""
    expansion = preprocessor.layout.expansion(list(indices), fps, width, height)
    if tuple(expansion.grid_thw) != tuple(grid_thw):
        raise VideoInputError(
            f"the frontend laid the video out as grid {tuple(grid_thw)}, this worker's settings "
            f"give {expansion.grid_thw}: the two disagree on the model's video settings"
        )
    return video_expansion_ids(
        expansion,
        encode,
        placeholder_id=placeholder_id,
        vision_start_id=vision_start_id,
        vision_end_id=vision_end_id,
    )
