"""Video frame sampling and token counts, held to transformers' own video code (the oracle).

The oracle is never our formula: each case calls transformers' `sample_frames`, its video
`smart_resize` / `get_num_of_video_patches`, and (Qwen3-VL) the processor's own
`replace_video_token` with its timestamp text, directly. Qwen2-VL's video processor module imports
torchvision at the top, which cannot be installed beside this torch: `_torchvision_import_shim`
(test-only) stands in for it while that module is imported; nothing the oracle calls uses it.
"""

from __future__ import annotations

import contextlib
import random
import sys
import types
from collections.abc import Iterator

import pytest

from routing.prompt.video_layouts import (
    QWEN2_VL_VIDEO_MAX_PIXELS,
    QWEN2_VL_VIDEO_MIN_PIXELS,
    QWEN3_VL_VIDEO_MAX_PIXELS,
    QWEN3_VL_VIDEO_MIN_PIXELS,
    VideoRefused,
    video_layout_for_config,
)

# Per settings row; each family is checked under three rows, so on 900 cases (the refused ones
# checked to be refused alike), at least 750 of them laid out.
CASES_PER_SETTINGS = 300
# Common frame rates, including the NTSC fractions PyAV reports as floats.
FRAME_RATES = (24.0, 25.0, 30.0, 60.0, 30000 / 1001, 24000 / 1001, 12.5, 15.0, 8.0, 1.0, 5.0, 120.0, 29.97)


@contextlib.contextmanager
def _torchvision_import_shim() -> Iterator[None]:
    """TEST-ONLY torchvision import shim: empty modules under torchvision's names, present only
    while transformers' Qwen2-VL video module is imported, then removed again."""
    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ]
    if any(name in sys.modules for name in names):
        yield
        return
    # transformers asks (once, cached) whether torchvision is installed: answer before the shim exists.
    from transformers.utils.import_utils import is_torchvision_available

    assert not is_torchvision_available()
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _qwen2_video_processor(**kwargs):
    with _torchvision_import_shim():
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    return Qwen2VLVideoProcessor(**kwargs)


def _qwen3_video_processor(**kwargs):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**kwargs)


def _cases(seed: int) -> list[tuple[int, int, int, float]]:
    """(frames, width, height, fps): short and long clips, tiny to 4K frames, odd shapes."""
    rng = random.Random(seed)
    cases = []
    for n in range(CASES_PER_SETTINGS):
        fps = rng.choice(FRAME_RATES) if n % 5 else round(rng.uniform(0.5, 90.0), 3)
        frames = rng.choice([rng.randint(2, 40), rng.randint(40, 2000), rng.randint(2000, 20000)])
        if n % 7 == 0:
            width, height = rng.randint(8, 200), rng.randint(8, 200)
        else:
            width, height = rng.randint(16, 3840), rng.randint(16, 2160)
        cases.append((frames, width, height, fps))
    return cases


def _metadata(frames: int, fps: float):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=frames, fps=fps)


QWEN2_SETTINGS = [
    {},  # the class defaults
    {"min_pixels": 56 * 56, "max_pixels": 448 * 448, "fps": 2.0},  # the demo model's
    {
        "fps": 1.0,
        "min_frames": 2,
        "max_frames": 64,
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},
    },
]


@pytest.mark.parametrize("settings", QWEN2_SETTINGS, ids=["defaults", "demo", "published-7b"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_sampling_and_token_counts_equal_transformers_video_processor(model_type, settings):
    # given our layout and transformers' Qwen2VLVideoProcessor with the same settings
    layout = video_layout_for_config({"model_type": model_type}, settings)
    kwargs = {k: v for k, v in settings.items() if k != "fps"}
    oracle = _qwen2_video_processor(**kwargs)
    fps = settings.get("fps", 2.0)
    size = dict(oracle.size)
    checked = 0
    for frames, width, height, video_fps in _cases(seed=len(settings) + len(model_type)):
        # when both sample the clip and size the sampled frames
        try:
            expected = oracle.sample_frames(_metadata(frames, video_fps), fps=fps).tolist()
        except (ValueError, ZeroDivisionError):
            with pytest.raises(VideoRefused):
                layout.sample_indices(frames, video_fps)
            continue
        indices = layout.sample_indices(frames, video_fps)
        # then the kept frames are the same, and so is the token count
        assert indices == expected, (frames, width, height, video_fps)
        try:
            patches = oracle.get_num_of_video_patches(len(indices), height, width, {"size": size})
        except ValueError:
            with pytest.raises(VideoRefused):
                layout.expansion(indices, video_fps, width, height)
            continue
        expansion = layout.expansion(indices, video_fps, width, height)
        assert expansion.placeholder_tokens == patches // oracle.merge_size**2, (
            frames,
            width,
            height,
            video_fps,
        )
        assert expansion.timestamps == ()
        checked += 1
    assert checked >= 250


QWEN3_SETTINGS = [
    {},  # the class defaults
    {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2},  # the published 8B's
    {
        "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 32 * 32 * 2},
        "fps": 1.0,
        "min_frames": 2,
        "max_frames": 32,
    },
]


@pytest.mark.parametrize("settings", QWEN3_SETTINGS, ids=["defaults", "published-8b", "demo-like"])
def test_qwen3_vl_sampling_token_counts_and_timestamps_equal_transformers(settings):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    # given our layout and transformers' Qwen3VLVideoProcessor (and its processor's prompt text)
    layout = video_layout_for_config({"model_type": "qwen3_vl"}, settings)
    oracle = _qwen3_video_processor(**settings)
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)  # only its text expansion is used
    processor.video_processor = oracle
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    processor.video_token = "<|video_pad|>"
    checked = 0
    for frames, width, height, video_fps in _cases(seed=len(settings) + 3):
        # when both sample the clip, size it, and write its placeholder text
        metadata = _metadata(frames, video_fps)
        expected = oracle.sample_frames(metadata).tolist()
        indices = layout.sample_indices(frames, video_fps)
        assert indices == expected, (frames, width, height, video_fps)
        try:
            patches = oracle.get_num_of_video_patches(len(indices), height, width)
        except ValueError:
            with pytest.raises(VideoRefused):
                layout.expansion(indices, video_fps, width, height)
            continue
        expansion = layout.expansion(indices, video_fps, width, height)
        assert expansion.placeholder_tokens == patches // oracle.merge_size**2
        metadata.frames_indices = expected
        grid = [expansion.grid_thw]  # checked against the oracle's patch count just above
        expected_text = processor.replace_video_token(
            {"video_grid_thw": _tensor(grid), "video_metadata": [metadata]}, 0
        )
        # then the prompt text is the processor's, timestamps and all
        ours = "".join(
            f"{stamp}<|vision_start|>{'<|video_pad|>' * expansion.tokens_per_group}<|vision_end|>"
            for stamp in expansion.timestamps
        )
        assert ours == expected_text, (frames, width, height, video_fps)
        checked += 1
    assert checked >= 250


def _tensor(rows):
    import torch

    return torch.tensor(rows)


def test_layouts_read_the_video_processor_defaults_of_each_family():
    qwen2 = video_layout_for_config({"model_type": "qwen2_vl"}, {})
    qwen3 = video_layout_for_config({"model_type": "qwen3_vl"}, {})
    assert (qwen2.min_pixels, qwen2.max_pixels, qwen2.patch_size) == (
        QWEN2_VL_VIDEO_MIN_PIXELS,
        QWEN2_VL_VIDEO_MAX_PIXELS,
        14,
    )
    assert (qwen3.min_pixels, qwen3.max_pixels, qwen3.patch_size) == (
        QWEN3_VL_VIDEO_MIN_PIXELS,
        QWEN3_VL_VIDEO_MAX_PIXELS,
        16,
    )
    assert video_layout_for_config({"model_type": "llava"}, {}) is None


def test_a_one_frame_clip_is_refused_by_both_families():
    for model_type in ("qwen2_vl", "qwen3_vl"):
        layout = video_layout_for_config({"model_type": model_type}, {})
        with pytest.raises(VideoRefused):
            layout.expansion(layout.sample_indices(1, 30.0), 30.0, 64, 64)
