"""The worker's side of a video: the demo Qwen3-VL checkpoint, and the frontend's frames turned into
the vision tower's patches as transformers' video processors cut them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from routing.media.video import VideoLimits, decode_video
from tests.test_video_layouts import _torchvision_import_shim
from tests.video_files import make_clip
from workers.video_inputs import VideoInputError, VideoPreprocessor, patchify, video_prompt_ids


def test_build_demo_model_builds_qwen3_vl_with_video_settings(tmp_path):
    from django.core.management import call_command
    from transformers import AutoConfig, AutoTokenizer

    # given the command with --family qwen3_vl
    call_command("build_demo_model", str(tmp_path / "q3"), "--family", "qwen3_vl")
    # then the checkpoint is a Qwen3-VL whose token ids are the tokenizer's
    config = AutoConfig.from_pretrained(tmp_path / "q3")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "q3")
    assert config.model_type == "qwen3_vl"
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    video = json.loads((tmp_path / "q3" / "video_preprocessor_config.json").read_text())
    assert (video["patch_size"], video["fps"]) == (16, 2.0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_patches_are_cut_as_transformers_video_processor_cuts_them(family, demo_model_dir, qwen3_demo_dir):
    # given frames of a size that does not fill the last temporal patch (7 frames)
    preprocessor = VideoPreprocessor.for_model_dir(demo_model_dir if family == "qwen2" else qwen3_demo_dir)
    factor = preprocessor.layout.patch_size * preprocessor.layout.merge_size
    videos = torch.randn(1, 7, 3, 3 * factor, 2 * factor)
    if family == "qwen2":
        with _torchvision_import_shim():
            from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
        oracle = Qwen2VLVideoProcessor()
    else:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        oracle = Qwen3VLVideoProcessor()
    layout = preprocessor.layout
    # then our patches are transformers' own patchify's, bit for bit
    expected = oracle.patchify(videos, layout.patch_size, layout.merge_size, layout.temporal_patch_size)[0]
    assert torch.equal(patchify(videos, layout), expected)


def test_pixel_values_are_the_normalised_frames_and_the_prompt_run_matches_the_frontends(qwen3_demo_dir):
    from transformers import AutoTokenizer

    preprocessor = VideoPreprocessor.for_model_dir(qwen3_demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_demo_dir)
    indices, fps, _, width, height, _, expansion, frames = decode_video(
        make_clip(frames=48, width=160, height=120, fps=12), preprocessor.layout, VideoLimits()
    )
    shape = (len(indices), expansion.resized_height, expansion.resized_width, 3)
    pixels = preprocessor.pixel_values(frames, shape)
    grid_t, grid_h, grid_w = expansion.grid_thw
    assert pixels.shape == (grid_t * grid_h * grid_w, 3 * 2 * 16 * 16)
    first_pixel = np.frombuffer(frames, np.uint8)[0]
    # mean/std 0.5: [0, 255] to [-1, 1]; the first value is the first frame's first red sample
    assert pixels[0, 0].item() == pytest.approx(first_pixel / 255 * 2 - 1, abs=1e-6)
    ids = video_prompt_ids(
        preprocessor,
        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
        fps=fps,
        indices=indices,
        width=width,
        height=height,
        grid_thw=expansion.grid_thw,
        placeholder_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    # one timestamp, a start marker, the group's placeholders and an end marker per temporal group
    assert ids.count(tokenizer.convert_tokens_to_ids("<|video_pad|>")) == expansion.placeholder_tokens
    assert ids.count(tokenizer.convert_tokens_to_ids("<|vision_start|>")) == grid_t
    with pytest.raises(VideoInputError):
        video_prompt_ids(
            preprocessor,
            lambda text: [],
            fps=fps,
            indices=indices,
            width=width,
            height=height,
            grid_thw=(grid_t, grid_h + 2, grid_w),
            placeholder_id=1,
            vision_start_id=2,
            vision_end_id=3,
        )
    with pytest.raises(VideoInputError):
        preprocessor.pixel_values(frames[:-1], shape)
