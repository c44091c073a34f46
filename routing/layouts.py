"""How each supported vision-language model family expands a W×H image into placeholder tokens.

Pure arithmetic that mirrors transformers' image processors (the tests hold it to their output),
so the web process counts image tokens from a size alone, without loading transformers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

QWEN_IMAGE_PLACEHOLDER = "<|image_pad|>"
LLAVA_IMAGE_PLACEHOLDER = "<image>"

# Qwen's smart_resize raises beyond this ratio of the long side to the short side.
QWEN_MAX_ASPECT_RATIO = 200

# transformers' Qwen2VLImageProcessor class defaults (size shortest_edge / longest_edge).
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 1280
# transformers has no Qwen3-VL image processor class: the published checkpoints configure the
# Qwen2-VL one with these values, so they are the family's defaults.
QWEN3_VL_MIN_PIXELS = 256 * 256
QWEN3_VL_MAX_PIXELS = 4096 * 4096

# LlavaNextConfig's default anyres resolutions, as (height, width).
LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))

FAMILY_NAMES = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL-MoE",
    "llava": "LLaVA-1.5",
    "llava_next": "LLaVA-NeXT",
}


class ImageSizeRefused(ValueError):
    """The model's processor would refuse an image of this size, so the request cannot be served."""

    def __init__(self, width: int, height: int, reason: str) -> None:
        self.width = width
        self.height = height
        super().__init__(f"image of {width}x{height} {reason}")


@runtime_checkable
class ImageLayout(Protocol):
    """How one model family turns an image into a run of placeholder tokens."""

    @property
    def family(self) -> str: ...

    @property
    def placeholder_token(self) -> str:
        """The token the chat template emits once per image, expanded to `image_tokens` copies."""
        ...

    def image_tokens(self, width: int, height: int) -> int: ...


def _refuse_degenerate(width: int, height: int) -> None:
    if width < 1 or height < 1:
        raise ImageSizeRefused(width, height, "has a side under 1 pixel, which no image processor accepts")


@dataclass(frozen=True, slots=True)
class QwenVLLayout:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: smart_resize to multiples of patch·merge, then merged patches."""

    family: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    placeholder_token: str = QWEN_IMAGE_PLACEHOLDER

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the processor resizes to: the arithmetic of transformers' smart_resize."""
        _refuse_degenerate(width, height)
        ratio = max(height, width) / min(height, width)
        if ratio > QWEN_MAX_ASPECT_RATIO:
            name = FAMILY_NAMES.get(self.family, self.family)
            raise ImageSizeRefused(
                width,
                height,
                f"has an aspect ratio of {ratio:.4g}, over {QWEN_MAX_ASPECT_RATIO}, which {name} refuses",
            )
        factor = self.patch_size * self.merge_size
        # The same float operations in the same order as the processor, so rounding agrees exactly.
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """The processor's image_grid_thw for one image: (temporal, height, width) in patches."""
        resized_height, resized_width = self.resized_size(width, height)
        # A still image is one temporal patch (the processor repeats it temporal_patch_size times).
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        t, h, w = self.grid_thw(width, height)
        return t * h * w // (self.merge_size * self.merge_size)


@dataclass(frozen=True, slots=True)
class LlavaLayout:
    """LLaVA-1.5: every image becomes one fixed-size tile, so the count never depends on the size."""

    tokens_per_image: int
    family: str = "llava"
    placeholder_token: str = LLAVA_IMAGE_PLACEHOLDER

    def image_tokens(self, width: int, height: int) -> int:
        _refuse_degenerate(width, height)
        return self.tokens_per_image


@dataclass(frozen=True, slots=True)
class LlavaNextLayout:
    """LLaVA-NeXT anyres: a best-fit grid of tiles (unpadded, a newline per row) plus the base tile.

    Counts as transformers' LlavaNextProcessor does (_get_number_of_features and its unpadding).
    """

    pinpoints: tuple[tuple[int, int], ...]
    tile_height: int
    tile_width: int
    patch_size: int
    num_additional_image_tokens: int
    drops_first_feature: bool
    family: str = "llava_next"
    placeholder_token: str = LLAVA_IMAGE_PLACEHOLDER

    def best_resolution(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the pinpoint the processor picks; transformers' select_best_resolution."""
        best_fit = self.pinpoints[0]
        max_effective = 0
        min_wasted = math.inf
        for pin_height, pin_width in self.pinpoints:
            scale = min(pin_width / width, pin_height / height)
            downscaled_width, downscaled_height = int(width * scale), int(height * scale)
            effective = min(downscaled_width * downscaled_height, width * height)
            wasted = pin_width * pin_height - effective
            if effective > max_effective or (effective == max_effective and wasted < min_wasted):
                max_effective = effective
                min_wasted = wasted
                best_fit = (pin_height, pin_width)
        return best_fit

    def image_tokens(self, width: int, height: int) -> int:
        _refuse_degenerate(width, height)
        return _llava_next_tokens(self, width, height)


# Long pinpoint lists make the best-fit search the costly part; sizes repeat a lot in traffic.
@lru_cache(maxsize=8192)
def _llava_next_tokens(layout: LlavaNextLayout, width: int, height: int) -> int:
    best_height, best_width = layout.best_resolution(width, height)
    patches_height = layout.tile_height // layout.patch_size
    patches_width = layout.tile_width // layout.patch_size
    current_height = patches_height * (best_height // layout.tile_height)
    current_width = patches_width * (best_width // layout.tile_width)
    # The grid was padded to the pinpoint's shape; the model drops the padded rows or columns.
    if width / height > current_width / current_height:
        new_height = int(round(height * (current_width / width), 7))
        current_height -= (current_height - new_height) // 2 * 2
    else:
        new_width = int(round(width * (current_height / height), 7))
        current_width -= (current_width - new_width) // 2 * 2
    unpadded = current_height * current_width
    newlines = current_height
    base = patches_height * patches_width + layout.num_additional_image_tokens
    return unpadded + newlines + base - (1 if layout.drops_first_feature else 0)


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _qwen_pixel_bounds(
    preprocessor: Mapping[str, Any], min_default: int, max_default: int
) -> tuple[int, int]:
    # Like the processor: top-level min_pixels/max_pixels win over size.shortest_edge/longest_edge.
    # Inside `size`, min_pixels/max_pixels are read too (older configs wrote them there).
    size = preprocessor.get("size") or {}
    min_pixels = preprocessor.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    max_pixels = preprocessor.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    return (
        _positive_int(min_pixels or min_default, "min_pixels"),
        _positive_int(max_pixels or max_default, "max_pixels"),
    )


def _qwen_builder(
    patch_size: int, min_pixels: int, max_pixels: int
) -> Callable[[str, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], ImageLayout]:
    def build(
        family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any], processor: Mapping[str, Any]
    ) -> ImageLayout:
        low, high = _qwen_pixel_bounds(preprocessor, min_pixels, max_pixels)
        return QwenVLLayout(
            family=family,
            patch_size=_positive_int(preprocessor.get("patch_size", patch_size), "patch_size"),
            merge_size=_positive_int(preprocessor.get("merge_size", 2), "merge_size"),
            temporal_patch_size=_positive_int(
                preprocessor.get("temporal_patch_size", 2), "temporal_patch_size"
            ),
            min_pixels=low,
            max_pixels=high,
        )

    return build


def _tile_size(
    preprocessor: Mapping[str, Any], default_side: int, square_from_shortest_edge: bool
) -> tuple[int, int] | None:
    """(height, width) of one processed tile: the centre crop, else the resize target; None if it varies."""
    if not preprocessor:
        return default_side, default_side
    if preprocessor.get("do_center_crop", True):
        crop_size = preprocessor.get("crop_size")
        if crop_size is None:
            return default_side, default_side
        if isinstance(crop_size, int):
            return crop_size, crop_size
        return int(crop_size["height"]), int(crop_size["width"])
    size = preprocessor.get("size")
    if isinstance(size, int):
        return size, size
    if isinstance(size, Mapping):
        if "height" in size and "width" in size:
            return int(size["height"]), int(size["width"])
        # A shortest-edge resize keeps the aspect ratio, so the tile is square only when the image
        # was square already (LLaVA-NeXT's tiles, LLaVA's pad-to-square).
        if "shortest_edge" in size and square_from_shortest_edge:
            return int(size["shortest_edge"]), int(size["shortest_edge"])
    return None


def _vision_side_and_patch(config: Mapping[str, Any], processor: Mapping[str, Any]) -> tuple[int, int]:
    vision = config.get("vision_config") or {}
    side = _positive_int(vision.get("image_size", 336), "vision_config.image_size")
    patch = _positive_int(processor.get("patch_size") or vision.get("patch_size", 14), "patch_size")
    return side, patch


def _llava_feature_adjustment(config: Mapping[str, Any], processor: Mapping[str, Any]) -> tuple[int, bool]:
    # The CLIP tower (the family's default) prepends a CLS feature; the "default" strategy drops the
    # first feature, so a CLIP LLaVA gets exactly the patch count. A saved processor states both.
    vision_type = (config.get("vision_config") or {}).get("model_type", "clip_vision_model")
    additional = processor.get("num_additional_image_tokens")
    if additional is None:
        additional = 1 if vision_type == "clip_vision_model" else 0
    strategy = processor.get("vision_feature_select_strategy") or config.get(
        "vision_feature_select_strategy", "default"
    )
    return int(additional), strategy == "default"


def _build_llava(
    family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any], processor: Mapping[str, Any]
) -> ImageLayout | None:
    side, patch = _vision_side_and_patch(config, processor)
    tile = _tile_size(preprocessor, side, bool(preprocessor.get("do_pad", False)))
    if tile is None:
        # Without a fixed tile the count would follow each image's aspect ratio, which the CLIP
        # tower's fixed position embeddings cannot serve: route on the text prefix instead.
        return None
    additional, drops_first = _llava_feature_adjustment(config, processor)
    tokens = (tile[0] // patch) * (tile[1] // patch) + additional - (1 if drops_first else 0)
    return LlavaLayout(tokens_per_image=tokens)


def _build_llava_next(
    family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any], processor: Mapping[str, Any]
) -> ImageLayout | None:
    side, patch = _vision_side_and_patch(config, processor)
    tile = _tile_size(preprocessor, side, square_from_shortest_edge=True)
    if tile is None:
        return None
    # The processor expands with its own pinpoints; the model config's are the fallback.
    pinpoints = (
        preprocessor.get("image_grid_pinpoints") or config.get("image_grid_pinpoints") or LLAVA_NEXT_PINPOINTS
    )
    additional, drops_first = _llava_feature_adjustment(config, processor)
    return LlavaNextLayout(
        pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
        tile_height=tile[0],
        tile_width=tile[1],
        patch_size=patch,
        num_additional_image_tokens=additional,
        drops_first_feature=drops_first,
    )


_FAMILIES: dict[
    str, Callable[[str, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], ImageLayout | None]
] = {
    "qwen2_vl": _qwen_builder(14, QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS),
    "qwen2_5_vl": _qwen_builder(14, QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS),
    "qwen3_vl": _qwen_builder(16, QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
    "qwen3_vl_moe": _qwen_builder(16, QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
    "llava": _build_llava,
    "llava_next": _build_llava_next,
}

SUPPORTED_FAMILIES = frozenset(_FAMILIES)


def layout_for_config(
    config: Mapping[str, Any],
    preprocessor: Mapping[str, Any] | None,
    processor: Mapping[str, Any] | None = None,
) -> ImageLayout | None:
    """The layout of a checkpoint from its config.json and image-processor settings.

    `preprocessor` is preprocessor_config.json (or the `image_processor` section of
    processor_config.json, which is also accepted whole); `processor` holds processor-level
    settings such as LLaVA's `num_additional_image_tokens`. None for a family not in the registry:
    such a model routes on its text prefix.
    """
    build = _FAMILIES.get(str(config.get("model_type", "")))
    if build is None:
        return None
    preprocessor = dict(preprocessor or {})
    processor = dict(processor or {})
    nested = preprocessor.get("image_processor")
    if isinstance(nested, Mapping):
        processor = {**{k: v for k, v in preprocessor.items() if k != "image_processor"}, **processor}
        preprocessor = dict(nested)
    return build(config["model_type"], config, preprocessor, processor)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def layout_for_model_dir(path: Path) -> ImageLayout | None:
    """The layout of a local checkpoint directory, reading its files as transformers does.

    transformers 5 saves a processor as one processor_config.json with an `image_processor`
    section, which wins over preprocessor_config.json when present (the order transformers loads
    them in); older checkpoints keep the image settings in preprocessor_config.json and only
    processor-level settings in processor_config.json.
    """
    path = Path(path)
    config = _read_json(path / "config.json")
    if config is None:
        raise FileNotFoundError(f"{path} has no config.json")
    processor = _read_json(path / "processor_config.json") or {}
    preprocessor = processor.get("image_processor")
    if not isinstance(preprocessor, Mapping):
        preprocessor = _read_json(path / "preprocessor_config.json")
    processor_settings = {k: v for k, v in processor.items() if k != "image_processor"}
    return layout_for_config(config, preprocessor, processor_settings)
