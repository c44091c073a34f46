"""How each supported vision-language model family expands a W×H image into placeholder tokens.

Pure arithmetic that mirrors transformers' image processors (the tests hold it to their output),
so the web process counts image tokens from a size alone, without loading transformers.

Most families turn the one placeholder the chat template emits into a run of copies of it; some
(Llama 4's tiles, Nemotron Omni's <img>...</img>) wrap or split that run with marker tokens, so a
layout gives its `expansion`: the runs of (token, count) the placeholder becomes, in order.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

QWEN_IMAGE_PLACEHOLDER = "<|image_pad|>"
LLAVA_IMAGE_PLACEHOLDER = "<image>"
KIMI_IMAGE_PLACEHOLDER = "<|media_pad|>"
NEMOTRON_IMAGE_PLACEHOLDER = "<image>"
NEMOTRON_IMAGE_START = "<img>"
NEMOTRON_IMAGE_END = "</img>"
# Llama4Processor writes these literally, whatever its constructor was given.
LLAMA4_IMAGE_PLACEHOLDER = "<|image|>"
LLAMA4_IMAGE_START = "<|image_start|>"
LLAMA4_IMAGE_END = "<|image_end|>"
LLAMA4_PATCH = "<|patch|>"
LLAMA4_TILE_X_SEPARATOR = "<|tile_x_separator|>"
LLAMA4_TILE_Y_SEPARATOR = "<|tile_y_separator|>"

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

# Qwen2VLImageProcessor's class defaults: what a saved preprocessor config that omits a key gets.
QWEN2_VL_CLASS_PATCH_SIZE = 14

FAMILY_NAMES = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL-MoE",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE / Qwen3.6",
    "llava": "LLaVA-1.5",
    "llava_next": "LLaVA-NeXT",
    "llama4": "Llama 4",
    "kimi_k25": "Kimi K2.5 / K2.6",
    "nemotron_h_omni": "Nemotron 3 Nano Omni",
}

# The runs of (token, count) one image's placeholder becomes, in prompt order.
Expansion = tuple[tuple[str, int], ...]


class LayoutConfigError(ValueError):
    """The checkpoint's image settings are ones its transformers processor refuses (or cannot serve).

    Raised when the layout is read, i.e. at start-up: counting tokens for settings the engine
    would never run with would route every image request on numbers no worker produces.
    """


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
        """The token the chat template emits once per image; the processor replaces it."""
        ...

    @property
    def vocabulary(self) -> tuple[str, ...]:
        """Every token an expansion may hold (the placeholder first)."""
        ...

    def image_tokens(self, width: int, height: int, images_in_prompt: int = 1) -> int:
        """How many tokens the image's placeholder becomes (markers and separators included)."""
        ...

    def expansion(self, width: int, height: int, images_in_prompt: int = 1) -> Expansion:
        """The runs of (token, count) the image's placeholder becomes."""
        ...


def _single_run(layout: Any, width: int, height: int) -> Expansion:
    return ((layout.placeholder_token, layout.image_tokens(width, height)),)


def _refuse_degenerate(width: int, height: int) -> None:
    if width < 1 or height < 1:
        raise ImageSizeRefused(width, height, "has a side under 1 pixel, which no image processor accepts")


def qwen_smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) of transformers' Qwen2-VL smart_resize, aspect-ratio check left to the caller.

    The same float operations in the same order as the processor, so rounding agrees exactly.
    """
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


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
        return qwen_smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """The processor's image_grid_thw for one image: (temporal, height, width) in patches."""
        resized_height, resized_width = self.resized_size(width, height)
        # A still image is one temporal patch (the processor repeats it temporal_patch_size times).
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    @property
    def vocabulary(self) -> tuple[str, ...]:
        return (self.placeholder_token,)

    def image_tokens(self, width: int, height: int, images_in_prompt: int = 1) -> int:
        t, h, w = self.grid_thw(width, height)
        return t * h * w // (self.merge_size * self.merge_size)

    def expansion(self, width: int, height: int, images_in_prompt: int = 1) -> Expansion:
        return _single_run(self, width, height)


@dataclass(frozen=True, slots=True)
class LlavaLayout:
    """LLaVA-1.5: every image becomes one fixed-size tile, so the count never depends on the size."""

    tokens_per_image: int
    family: str = "llava"
    placeholder_token: str = LLAVA_IMAGE_PLACEHOLDER

    @property
    def vocabulary(self) -> tuple[str, ...]:
        return (self.placeholder_token,)

    def image_tokens(self, width: int, height: int, images_in_prompt: int = 1) -> int:
        _refuse_degenerate(width, height)
        return self.tokens_per_image

    def expansion(self, width: int, height: int, images_in_prompt: int = 1) -> Expansion:
        return _single_run(self, width, height)


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

    @property
    def vocabulary(self) -> tuple[str, ...]:
        return (self.placeholder_token,)

    def image_tokens(self, width: int, height: int, images_in_prompt: int = 1) -> int:
        _refuse_degenerate(width, height)
        return _llava_next_tokens(self, width, height)

    def expansion(self, width: int, height: int, images_in_prompt: int = 1) -> Expansion:
        return _single_run(self, width, height)


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


_FLOAT32 = struct.Struct("<f")


def _float32(value: float) -> float:
    """`value` rounded to float32, as torch's default dtype holds it.

    Exact for quotients of integers under 2**24: the double is rounded once more, and such a
    quotient never lies close enough to a float32 midpoint for the two roundings to disagree.
    """
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


@lru_cache(maxsize=64)
def _llama4_canvases(max_tiles: int, tile: int) -> tuple[tuple[int, int], ...]:
    """(height, width) of every canvas of at most `max_tiles` tiles, in transformers' order.

    The order matters: among canvases of equal scale and area the processor keeps the first
    (find_supported_resolutions groups the tile grids by aspect ratio, largest tile counts first).
    """
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for tiles in range(max_tiles, 0, -1):
        divisors = (i for i in range(1, math.isqrt(tiles) + 1) if tiles % i == 0)
        factors = sorted({d for i in divisors for d in (i, tiles // i)})
        for rows in factors:
            by_ratio.setdefault(rows / (tiles // rows), []).append((rows, tiles // rows))
    return tuple((rows * tile, columns * tile) for grids in by_ratio.values() for rows, columns in grids)


@dataclass(frozen=True, slots=True)
class Llama4Layout:
    """Llama 4: the image on a canvas of up to `max_tiles` square tiles, plus a global tile.

    The placeholder becomes <|image_start|>, one run of patch tokens per tile (tiles of a row
    separated by <|tile_x_separator|>, each row ended by <|tile_y_separator|>), then <|image|> and
    the global tile's patch tokens, then <|image_end|>; a one-tile image has only the global part.
    As Llama4Processor._prompt_split_image lays it out.
    """

    tile: int
    max_tiles: int
    resize_to_max_canvas: bool
    tokens_per_tile: int
    family: str = "llama4"
    placeholder_token: str = LLAMA4_IMAGE_PLACEHOLDER
    # The config's image_token_index names the patch token; the template emits <|image|>.
    config_names_placeholder: bool = False

    @property
    def vocabulary(self) -> tuple[str, ...]:
        # dict.fromkeys: the placeholder first, once, whether or not it is the literal <|image|>.
        return tuple(
            dict.fromkeys(
                (
                    self.placeholder_token,
                    LLAMA4_IMAGE_PLACEHOLDER,
                    LLAMA4_IMAGE_START,
                    LLAMA4_IMAGE_END,
                    LLAMA4_PATCH,
                    LLAMA4_TILE_X_SEPARATOR,
                    LLAMA4_TILE_Y_SEPARATOR,
                )
            )
        )

    def tile_grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of tiles: transformers' get_best_fit over the supported canvases."""
        _refuse_degenerate(width, height)
        return _llama4_tile_grid(self, width, height)

    def image_tokens(self, width: int, height: int, images_in_prompt: int = 1) -> int:
        rows, columns = self.tile_grid(width, height)
        local = rows * columns * self.tokens_per_tile + rows * columns if rows * columns > 1 else 0
        return local + self.tokens_per_tile + 3

    def expansion(self, width: int, height: int, images_in_prompt: int = 1) -> Expansion:
        rows, columns = self.tile_grid(width, height)
        runs: list[tuple[str, int]] = [(LLAMA4_IMAGE_START, 1)]
        if rows * columns > 1:
            for _ in range(rows):
                for column in range(columns):
                    runs.append((LLAMA4_PATCH, self.tokens_per_tile))
                    if column < columns - 1:
                        runs.append((LLAMA4_TILE_X_SEPARATOR, 1))
                runs.append((LLAMA4_TILE_Y_SEPARATOR, 1))
        # The processor writes <|image|> here literally, whatever its image_token is.
        runs += [(LLAMA4_IMAGE_PLACEHOLDER, 1), (LLAMA4_PATCH, self.tokens_per_tile), (LLAMA4_IMAGE_END, 1)]
        return tuple(runs)


@lru_cache(maxsize=8192)
def _llama4_tile_grid(layout: Llama4Layout, width: int, height: int) -> tuple[int, int]:
    canvases = _llama4_canvases(layout.max_tiles, layout.tile)
    # get_best_fit divides in torch's float32; the same roundings keep its ties and its choices.
    scales = []
    for canvas_height, canvas_width in canvases:
        scale_w = _float32(canvas_width / width)
        scale_h = _float32(canvas_height / height)
        scales.append(scale_w if scale_h > scale_w else scale_h)
    upscaling = [scale for scale in scales if scale >= 1]
    if upscaling:
        chosen_scale = max(upscaling) if layout.resize_to_max_canvas else min(upscaling)
    else:
        chosen_scale = max(scale for scale in scales if scale < 1)
    chosen = [canvas for canvas, scale in zip(canvases, scales, strict=True) if scale == chosen_scale]
    # Several canvases fit equally well: the least padding (smallest area, first one) wins.
    best_height, best_width = min(chosen, key=lambda canvas: canvas[0] * canvas[1])
    return best_height // layout.tile, best_width // layout.tile


@dataclass(frozen=True, slots=True)
class KimiK25Layout:
    """Kimi K2.5 / K2.6 (MoonViT): never upscaled, scaled down into a patch budget and a per-side
    limit, padded to multiples of patch·merge, then merged patches (transformers' navit_resize)."""

    patch_size: int
    merge_size: int
    max_patches: int
    max_patches_per_side: int
    family: str = "kimi_k25"
    placeholder_token: str = KIMI_IMAGE_PLACEHOLDER

    @property
    def vocabulary(self) -> tuple[str, ...]:
        return (self.placeholder_token,)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of patches of the padded image: the processor's image_grid_thw[1:]."""
        _refuse_degenerate(width, height)
        patch = self.patch_size
        # The same float operations in the same order as navit_resize, so rounding agrees exactly.
        patches_high = max(1.0, height // patch)
        patches_wide = max(1.0, width // patch)
        scale = min(
            1.0,
            math.sqrt(self.max_patches / (patches_high * patches_wide)),
            (self.max_patches_per_side * patch) / height,
            (self.max_patches_per_side * patch) / width,
        )
        side_limit = self.max_patches_per_side * patch
        new_height = min(max(1, int(height * scale)), side_limit)
        new_width = min(max(1, int(width * scale)), side_limit)
        factor = self.merge_size * patch
        padded_height = (factor - new_height % factor) % factor + new_height
        padded_width = (factor - new_width % factor) % factor + new_width
        return padded_height // patch, padded_width // patch

    def image_tokens(self, width: int, height: int, images_in_prompt: int = 1) -> int:
        rows, columns = self.grid(width, height)
        return rows * columns // (self.merge_size * self.merge_size)

    def expansion(self, width: int, height: int, images_in_prompt: int = 1) -> Expansion:
        return _single_run(self, width, height)


@dataclass(frozen=True, slots=True)
class NemotronOmniLayout:
    """Nemotron 3 Nano Omni images: a patch grid near the image's own, scaled into a patch budget,
    sides rounded to multiples of the pixel-shuffle merge; <img>, the merged patches, </img>.

    The budget is the context length's, clamped to [min_num_patches, max_num_patches], and
    grows with the number of images in the call when the cap is off or the context is short,
    which is why counting takes the number of images in the prompt.
    """

    patch_size: int
    merge_size: int
    min_num_patches: int
    max_num_patches: int
    max_model_len: int
    family: str = "nemotron_h_omni"
    placeholder_token: str = NEMOTRON_IMAGE_PLACEHOLDER

    @property
    def vocabulary(self) -> tuple[str, ...]:
        return (self.placeholder_token, NEMOTRON_IMAGE_START, NEMOTRON_IMAGE_END)

    def patch_budget(self, images_in_prompt: int) -> int:
        """The per-image patch budget the processor gives each of `images_in_prompt` images."""
        budget = max((self.max_model_len - 4) * self.merge_size**2, self.min_num_patches * images_in_prompt)
        if self.max_num_patches:
            budget = min(budget, self.max_num_patches)
        return max(budget, self.min_num_patches)

    def grid(self, width: int, height: int, images_in_prompt: int = 1) -> tuple[int, int]:
        """(rows, columns) of patches: transformers' get_patch_grid_size under the call's budget."""
        _refuse_degenerate(width, height)
        return _nemotron_grid(self, width, height, self.patch_budget(max(1, images_in_prompt)))

    def image_tokens(self, width: int, height: int, images_in_prompt: int = 1) -> int:
        rows, columns = self.grid(width, height, images_in_prompt)
        return rows * columns // self.merge_size**2 + 2

    def expansion(self, width: int, height: int, images_in_prompt: int = 1) -> Expansion:
        rows, columns = self.grid(width, height, images_in_prompt)
        return (
            (NEMOTRON_IMAGE_START, 1),
            (self.placeholder_token, rows * columns // self.merge_size**2),
            (NEMOTRON_IMAGE_END, 1),
        )


@lru_cache(maxsize=8192)
def _nemotron_grid(layout: NemotronOmniLayout, width: int, height: int, budget: int) -> tuple[int, int]:
    patch, merge, least = layout.patch_size, layout.merge_size, layout.min_num_patches
    # Python's round() (half to even) on purpose: the processor's expression, kept as it is.
    rows = round(height / patch + 0.5)
    columns = round(width / patch + 0.5)
    factor = min(math.sqrt(budget / (rows * columns)), 1.0)
    rows = math.floor(factor * rows)
    columns = math.floor(factor * columns)
    if budget > least and rows * columns < least:
        if rows * columns == 0:
            # The processor divides by this product and fails: such an image cannot be served.
            raise ImageSizeRefused(
                width, height, f"shrinks to an empty patch grid under a budget of {budget} patches"
            )
        factor = math.sqrt(least / (rows * columns))
        rows = math.ceil(factor * rows)
        columns = math.ceil(factor * columns)
    if remainder := rows % merge:
        if (rows + merge - remainder) * columns <= budget:
            rows += merge - remainder
        else:
            rows = max(merge, rows - remainder)
    if remainder := columns % merge:
        if rows * (columns + merge - remainder) <= budget:
            columns += merge - remainder
        else:
            columns = max(merge, columns - remainder)
    return rows, columns


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def _qwen_pixel_bounds(
    preprocessor: Mapping[str, Any], min_default: int, max_default: int
) -> tuple[int, int]:
    """(min_pixels, max_pixels) as Qwen2VLImageProcessor settles them, refusing what it refuses.

    The processor starts from `size` (its class default when absent), lets top-level
    min_pixels / max_pixels replace size's shortest_edge / longest_edge (dropping a min_pixels /
    max_pixels written inside `size`), and then needs exactly those two keys: a `size` with only
    `longest_edge`, or with min_pixels / max_pixels inside it and no top-level pair to replace
    them, fails on every image.
    """
    size = preprocessor.get("size")
    size = {"shortest_edge": min_default, "longest_edge": max_default} if size is None else dict(size)
    if preprocessor.get("min_pixels") is not None:
        size["shortest_edge"] = preprocessor["min_pixels"]
        size.pop("min_pixels", None)
    if preprocessor.get("max_pixels") is not None:
        size["longest_edge"] = preprocessor["max_pixels"]
        size.pop("max_pixels", None)
    if set(size) != {"shortest_edge", "longest_edge"}:
        raise LayoutConfigError(
            f"the image processor's size {size} must settle to exactly 'shortest_edge' and "
            "'longest_edge' (top-level min_pixels/max_pixels fill them in); transformers refuses "
            "every image with these settings"
        )
    return (
        _positive_int(size["shortest_edge"], "size.shortest_edge (min_pixels)"),
        _positive_int(size["longest_edge"], "size.longest_edge (max_pixels)"),
    )


def _qwen_builder(
    patch_size: int, min_pixels: int, max_pixels: int
) -> Callable[[str, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], ImageLayout]:
    """Qwen-VL families: the published values without a preprocessor config; with one, what the
    processor class fills in for the keys it leaves out (Qwen2VLImageProcessor's defaults)."""

    def build(
        family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any], processor: Mapping[str, Any]
    ) -> ImageLayout:
        if preprocessor:
            default_patch, default_min, default_max = (
                QWEN2_VL_CLASS_PATCH_SIZE,
                QWEN2_VL_MIN_PIXELS,
                QWEN2_VL_MAX_PIXELS,
            )
        else:
            default_patch, default_min, default_max = patch_size, min_pixels, max_pixels
        low, high = _qwen_pixel_bounds(preprocessor, default_min, default_max)
        return QwenVLLayout(
            family=family,
            patch_size=_positive_int(preprocessor.get("patch_size", default_patch), "patch_size"),
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


def _build_llama4(
    family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any], processor: Mapping[str, Any]
) -> ImageLayout:
    # Llama4ImageProcessor's and Llama4Processor's class defaults fill in what the files omit.
    if preprocessor.get("do_resize") is False:
        raise LayoutConfigError("Llama 4 always resizes images; transformers refuses do_resize=false")
    size = preprocessor.get("size") or {"height": 336, "width": 336}
    if not isinstance(size, Mapping) or not {"height", "width"} <= set(size):
        raise LayoutConfigError(f"Llama 4's image size must give height and width, got {size!r}")
    if size["height"] != size["width"]:
        raise LayoutConfigError(f"Llama 4's tiles must be square (transformers refuses {dict(size)})")
    tile = _positive_int(size["height"], "size.height")
    patch = _positive_int(processor.get("patch_size", 14), "patch_size")
    shuffle = processor.get("pixel_shuffle_ratio", 0.5)
    if not isinstance(shuffle, int | float) or isinstance(shuffle, bool) or not 0 < shuffle <= 1:
        raise LayoutConfigError(f"pixel_shuffle_ratio must be in (0, 1], got {shuffle!r}")
    downsample = round(1.0 / (shuffle**2))
    placeholder = processor.get("image_token", LLAMA4_IMAGE_PLACEHOLDER)
    if not isinstance(placeholder, str) or not placeholder:
        raise LayoutConfigError(f"Llama 4's image_token must be a token, got {placeholder!r}")
    return Llama4Layout(
        placeholder_token=placeholder,
        tile=tile,
        max_tiles=_positive_int(preprocessor.get("max_patches", 16), "max_patches"),
        resize_to_max_canvas=bool(preprocessor.get("resize_to_max_canvas", False)),
        tokens_per_tile=(tile // patch) * (tile // patch) // downsample,
    )


def _build_kimi_k25(
    family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any], processor: Mapping[str, Any]
) -> ImageLayout:
    # Kimi_K25ImageProcessor's class defaults fill in what the file omits.
    if preprocessor.get("do_resize") is False:
        raise LayoutConfigError("Kimi K2.5 without do_resize gives unpadded patch grids: not supported")
    size = preprocessor.get("size") or {"max_height": 512, "max_width": 512}
    if (
        not isinstance(size, Mapping)
        or size.get("max_height") is None
        or size.get("max_height") != size.get("max_width")
    ):
        raise LayoutConfigError(
            f"Kimi K2.5's size must hold 'max_height' and 'max_width' with identical values "
            f"(transformers refuses {size!r})"
        )
    layout = KimiK25Layout(
        patch_size=_positive_int(preprocessor.get("patch_size", 14), "patch_size"),
        merge_size=_positive_int(preprocessor.get("merge_size", 2), "merge_size"),
        max_patches=_positive_int(preprocessor.get("max_patches", 16384), "max_patches"),
        max_patches_per_side=_positive_int(size["max_height"], "size.max_height"),
    )
    # A checkpoint written for the remote-code processor keeps its limits in media_proc_cfg, which
    # transformers' class does not read: if they disagree with what it does read, no count is right.
    remote = preprocessor.get("media_proc_cfg")
    if isinstance(remote, Mapping):
        pairs = {
            "patch_size": layout.patch_size,
            "merge_kernel_size": layout.merge_size,
            "in_patch_limit": layout.max_patches,
            "patch_limit_on_one_side": layout.max_patches_per_side,
        }
        differing = {k: (remote[k], v) for k, v in pairs.items() if k in remote and remote[k] != v}
        if differing:
            raise LayoutConfigError(
                "media_proc_cfg disagrees with the settings transformers' Kimi processor uses "
                f"(media_proc_cfg value, transformers value): {differing}"
            )
    return layout


def _build_nemotron_omni(
    family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any], processor: Mapping[str, Any]
) -> ImageLayout:
    # NemotronH_Omni_Reasoning_V3ImageProcessor's class defaults fill in what the file omits.
    ratio = preprocessor.get("downsample_ratio", 0.5)
    if not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise LayoutConfigError(f"downsample_ratio must be in (0, 1], got {ratio!r}")
    max_patches = preprocessor.get("max_num_patches", 13312)
    if isinstance(max_patches, bool) or not isinstance(max_patches, int) or max_patches < 0:
        raise LayoutConfigError(f"max_num_patches must be 0 (no cap) or positive, got {max_patches!r}")
    return NemotronOmniLayout(
        patch_size=_positive_int(preprocessor.get("patch_size", 16), "patch_size"),
        merge_size=round(1 / ratio),
        min_num_patches=_positive_int(preprocessor.get("min_num_patches", 1024), "min_num_patches"),
        max_num_patches=max_patches,
        max_model_len=_positive_int(preprocessor.get("max_model_len", 16384), "max_model_len"),
    )


_FAMILIES: dict[
    str, Callable[[str, Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]], ImageLayout | None]
] = {
    "qwen2_vl": _qwen_builder(14, QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS),
    "qwen2_5_vl": _qwen_builder(14, QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS),
    "qwen3_vl": _qwen_builder(16, QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
    "qwen3_vl_moe": _qwen_builder(16, QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
    # Qwen3.5 and Qwen3.6 (dense and MoE) use Qwen3-VL's processor and settings.
    "qwen3_5": _qwen_builder(16, QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
    "qwen3_5_moe": _qwen_builder(16, QWEN3_VL_MIN_PIXELS, QWEN3_VL_MAX_PIXELS),
    "llava": _build_llava,
    "llava_next": _build_llava_next,
    "llama4": _build_llama4,
    "kimi_k25": _build_kimi_k25,
    "nemotron_h_omni": _build_nemotron_omni,
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
    such a model routes on its text prefix. Raises LayoutConfigError for settings the family's
    transformers processor refuses.
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
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise LayoutConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise LayoutConfigError(f"{path} does not hold a JSON object")
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
