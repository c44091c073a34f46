"""Checks the frontend processor's model inputs (the processor path) against the request's
images before anything runs: ids, grids and pixel rows must agree with each other. No model needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from routing.prompt.processor_view import token_runs
from workers.prompt_layout import ImageInput, PromptError, PromptImage, PromptLayout


def processed_prompt(
    layout: PromptLayout,
    images: Sequence[ImageInput],
    processed: dict[str, Any],
    *,
    vocab_size: int,
    video_token_id: int | None,
) -> tuple[list[int], list[PromptImage]]:
    """The frontend processor's input ids and image spans, checked against the request's
    images and their grids: a payload that disagrees with itself is refused, not run."""
    import torch

    if "pixel_values_videos" in processed or "video_grid_thw" in processed:
        raise PromptError("video inputs are not supported by this engine")
    try:
        ids = torch.as_tensor(processed["input_ids"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise PromptError("the processed inputs carry no usable input_ids") from exc
    if ids.is_floating_point() or ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise PromptError(f"processed input_ids must be one prompt's integer ids, not {tuple(ids.shape)}")
    input_ids = [int(i) for i in ids.reshape(-1).tolist()]
    vocab = vocab_size
    if not input_ids or min(input_ids) < 0 or max(input_ids) >= vocab:
        raise PromptError(f"processed input_ids must be non-empty and inside the vocabulary (0..{vocab - 1})")
    if video_token_id is not None and video_token_id in input_ids:
        raise PromptError("video inputs are not supported by this engine")
    if not layout.uses_mrope:
        return input_ids, _llava_processed_images(layout, images, input_ids, processed)

    spans = token_runs(input_ids, layout.image_token_id)
    if len(spans) != len(images):
        raise PromptError(f"the processed input ids hold {len(spans)} image spans for {len(images)} images")
    if not spans:
        return input_ids, []
    grids, pixel_values = processed.get("image_grid_thw"), processed.get("pixel_values")
    if not isinstance(grids, torch.Tensor) or not isinstance(pixel_values, torch.Tensor):
        raise PromptError("processed inputs with images need pixel_values and image_grid_thw tensors")
    if grids.is_floating_point() or tuple(grids.shape) != (len(spans), 3):
        raise PromptError(f"image_grid_thw must be {len(spans)} rows of (t, h, w), not {tuple(grids.shape)}")
    processor = layout.image_processor
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
    placed: list[PromptImage] = []
    row = 0
    for index, (source, (start, end), grid) in enumerate(zip(images, spans, grids.tolist(), strict=True)):
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
            PromptImage(
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
    layout: PromptLayout, images: Sequence[ImageInput], input_ids: list[int], processed: dict[str, Any]
) -> list[PromptImage]:
    """LLaVA images in the frontend's input ids. Adjacent images make one run of `<image>`
    tokens (nothing separates them), so runs are cut by each image's own token count."""
    import torch

    runs = token_runs(input_ids, layout.image_token_id)
    count = len(images)
    if not count:
        if runs:
            raise PromptError("the processed input ids hold image tokens but the request has no images")
        return []
    pixel_values, image_sizes = processed.get("pixel_values"), processed.get("image_sizes")
    next_family = layout.model_type == "llava_next"
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
            raise PromptError(f"LLaVA-NeXT processed inputs need image_sizes of {count} (height, width) rows")
        sizes = [(int(h), int(w)) for h, w in image_sizes.tolist()]
    else:
        tile = layout.image_processor.crop_size
        if tuple(pixel_values.shape[-2:]) != (tile["height"], tile["width"]):
            raise PromptError(
                f"pixel_values tiles must be {tile['height']}x{tile['width']}, "
                f"not {tuple(pixel_values.shape[-2:])}"
            )
        sizes = [(tile["height"], tile["width"])] * count  # LLaVA-1.5's count ignores the size
    lengths = layout.processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]

    placed: list[PromptImage] = []
    runs_left = list(runs)
    position = runs_left[0][0] if runs_left else 0
    for index, (source, length) in enumerate(zip(images, lengths, strict=True)):
        if not runs_left:
            raise PromptError(f"the processed input ids have no image tokens left for image {index}")
        run_end = runs_left[0][1]
        if position + length > run_end:
            raise PromptError(f"image {index} needs {length} image tokens, its run has {run_end - position}")
        placed.append(
            PromptImage(
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
