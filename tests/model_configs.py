"""Small checkpoint directories (config.json, preprocessor_config.json, processor_config.json) per family.

They carry the image settings the published checkpoints ship, so transformers' processors load
from them offline and tests can compare against them; there are no weights or tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def qwen2_vl_config(model_type: str = "qwen2_vl") -> dict[str, Any]:
    return {
        "model_type": model_type,
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }


def qwen2_vl_preprocessor(**overrides: Any) -> dict[str, Any]:
    """Qwen2-VL-7B-Instruct's published image settings (Qwen2.5-VL ships the same)."""
    return {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        **overrides,
    }


def qwen3_vl_config() -> dict[str, Any]:
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "vision_config": {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }


def qwen3_vl_preprocessor(**overrides: Any) -> dict[str, Any]:
    """Qwen3-VL-*-Instruct's published image settings: the Qwen2-VL processor with patch 16."""
    return {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
        **overrides,
    }


def llava_config() -> dict[str, Any]:
    return {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": 32000,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
    }


def llava_preprocessor(**overrides: Any) -> dict[str, Any]:
    """llava-hf/llava-1.5-7b-hf's published image settings."""
    return {
        "crop_size": {"height": 336, "width": 336},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 336},
        **overrides,
    }


def llava_processor(**overrides: Any) -> dict[str, Any]:
    """The processor-level settings llava-hf checkpoints keep in processor_config.json."""
    return {
        "processor_class": "LlavaProcessor",
        "patch_size": 14,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
        **overrides,
    }


def llava_next_config() -> dict[str, Any]:
    return {
        "model_type": "llava_next",
        "architectures": ["LlavaNextForConditionalGeneration"],
        "image_token_index": 32000,
        "image_grid_pinpoints": LLAVA_NEXT_PINPOINTS,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
    }


def llava_next_preprocessor(**overrides: Any) -> dict[str, Any]:
    """llava-hf/llava-v1.6-mistral-7b-hf's published image settings."""
    return {
        "crop_size": {"height": 336, "width": 336},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_grid_pinpoints": LLAVA_NEXT_PINPOINTS,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
        "image_processor_type": "LlavaNextImageProcessor",
        "processor_class": "LlavaNextProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 336},
        **overrides,
    }


def llava_next_processor(**overrides: Any) -> dict[str, Any]:
    return {**llava_processor(), "processor_class": "LlavaNextProcessor", **overrides}


# Where the published settings below come from. Each was found with the code search over public
# repositories (no download at run time: the values are embedded here):
# - Qwen3.5 / Qwen3.6: Qwen/Qwen3.5-397B-A17B's config.json (ai-dynamo/aiconfigurator,
#   src/aiconfigurator/model_configs/Qwen--Qwen3.5-397B-A17B_config.json): model_type
#   qwen3_5_moe, vision patch_size 16, spatial_merge_size 2, temporal_patch_size 2; its
#   preprocessor_config.json lists min 65536 and max 16777216 pixels (a public table of "released
#   image-processor settings", code-search excerpt 71552061222), as Qwen3-VL's; Qwen3.6-35B-A3B is
#   architecture `qwen3_5_moe` too (a public LoRA provenance note, excerpt 57862596444).
# - Llama 4: meta-llama/Llama-4-Scout-17B-16E-Instruct and Maverick, bundled checkpoint JSON checked
#   by a public test (excerpt 68383952491): image_processor_config max_patches 16,
#   resize_to_max_canvas false, global tile added; vision_config image_size 336, patch_size 14,
#   pixel_shuffle_ratio 0.5; image_token_index 200092 (<|patch|>), boi 200080, eoi 200081. The
#   size 336x336 default of the image processor is quoted in the same way (excerpt 68374371179).
# - Kimi K2.5: moonshotai/Kimi-K2.5's config.json (ai-dynamo/aiconfigurator,
#   src/aiconfigurator/model_configs/moonshotai--Kimi-K2.5_config.json): model_type kimi_k25,
#   vision patch_size 14, merge_kernel_size [2, 2]; its preprocessor_config.json media_proc_cfg:
#   patch_size 14, merge_kernel_size 2, in_patch_limit 16384, patch_limit_on_one_side 512 (ports quoting it:
#   excerpts 54589287414, 57858465447; the same table as above, 71552061222). transformers'
#   Kimi_K25ImageProcessor names them patch_size, merge_size, max_patches, size.max_height/width.
# - Nemotron 3 Nano Omni: the checkpoint's preprocessor_config.json (quoted in public port notes,
#   excerpt 59050332354): patch_size 16, downsample_ratio 0.5, min_num_patches 1024,
#   max_num_patches 13312, max_model_len 16384, CLIP norm_mean/norm_std; image tokens <image>
#   wrapped in <img>...</img> (config img_context_token / img_start_token / img_end_token, excerpt
#   52319869011).


def qwen3_5_config(model_type: str = "qwen3_5") -> dict[str, Any]:
    return {
        "model_type": model_type,
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if "moe" in model_type else "Qwen3_5ForConditionalGeneration"
        ],
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "vision_config": {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    }


def qwen3_5_preprocessor(**overrides: Any) -> dict[str, Any]:
    """Qwen3.5's published image settings: Qwen3-VL's, under Qwen3VLProcessor."""
    return qwen3_vl_preprocessor(**overrides)


def llama4_config() -> dict[str, Any]:
    return {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "image_token_index": 200092,
        "boi_token_index": 200080,
        "eoi_token_index": 200081,
        "vision_config": {
            "model_type": "llama4_vision_model",
            "image_size": 336,
            "patch_size": 14,
            "pixel_shuffle_ratio": 0.5,
        },
    }


def llama4_preprocessor(**overrides: Any) -> dict[str, Any]:
    """Llama-4-Scout/Maverick's published image settings."""
    return {
        "size": {"height": 336, "width": 336},
        "max_patches": 16,
        "resize_to_max_canvas": False,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "image_processor_type": "Llama4ImageProcessor",
        "processor_class": "Llama4Processor",
        **overrides,
    }


def llama4_processor(**overrides: Any) -> dict[str, Any]:
    return {
        "processor_class": "Llama4Processor",
        "fake_image_token": "<|image|>",
        "image_token": "<|image|>",
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        **overrides,
    }


def kimi_k25_config() -> dict[str, Any]:
    return {
        "model_type": "kimi_k25",
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "image_token_id": 163605,
        "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "merge_kernel_size": [2, 2]},
    }


def kimi_k25_preprocessor(**overrides: Any) -> dict[str, Any]:
    """Kimi K2.5's published image settings, in the keys transformers' Kimi processor reads."""
    return {
        "size": {"max_height": 512, "max_width": 512},
        "max_patches": 16384,
        "patch_size": 14,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Kimi_K25ImageProcessor",
        "processor_class": "Kimi_K25Processor",
        **overrides,
    }


def nemotron_omni_config() -> dict[str, Any]:
    return {
        "model_type": "nemotron_h_omni",
        "architectures": ["NemotronH_Omni_Reasoning_V3"],
        "downsample_ratio": 0.5,
        "img_context_token_id": 18,
    }


def nemotron_omni_preprocessor(**overrides: Any) -> dict[str, Any]:
    """Nemotron 3 Nano Omni's published image settings."""
    return {
        "patch_size": 16,
        "downsample_ratio": 0.5,
        "norm_mean": OPENAI_CLIP_MEAN,
        "norm_std": OPENAI_CLIP_STD,
        "min_num_patches": 1024,
        "max_num_patches": 13312,
        "max_model_len": 16384,
        "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
        "processor_class": "NemotronH_Omni_Reasoning_V3Processor",
        **overrides,
    }


# model_type -> (config.json, preprocessor_config.json with overrides, processor_config.json or None)
FAMILIES: dict[
    str, tuple[Callable[[], dict[str, Any]], Callable[..., dict[str, Any]], Callable[[], dict] | None]
] = {
    "qwen2_vl": (qwen2_vl_config, qwen2_vl_preprocessor, None),
    "qwen2_5_vl": (lambda: qwen2_vl_config("qwen2_5_vl"), qwen2_vl_preprocessor, None),
    "qwen3_vl": (qwen3_vl_config, qwen3_vl_preprocessor, None),
    "llava": (llava_config, llava_preprocessor, llava_processor),
    "llava_next": (llava_next_config, llava_next_preprocessor, llava_next_processor),
    "qwen3_5": (qwen3_5_config, qwen3_5_preprocessor, None),
    "qwen3_5_moe": (lambda: qwen3_5_config("qwen3_5_moe"), qwen3_5_preprocessor, None),
    "llama4": (llama4_config, llama4_preprocessor, llama4_processor),
    "kimi_k25": (kimi_k25_config, kimi_k25_preprocessor, None),
    "nemotron_h_omni": (nemotron_omni_config, nemotron_omni_preprocessor, None),
}


def write_model_dir(
    directory: Path,
    config: dict[str, Any],
    preprocessor: dict[str, Any] | None = None,
    processor: dict[str, Any] | None = None,
) -> Path:
    """Writes the given JSON files into `directory` (created if needed) and returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if preprocessor is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    if processor is not None:
        (directory / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return directory


def write_family_dir(directory: Path, model_type: str, **preprocessor_overrides: Any) -> Path:
    """A checkpoint directory of one family with its published settings, some of them overridden."""
    config, preprocessor, processor = FAMILIES[model_type]
    return write_model_dir(
        directory,
        config(),
        preprocessor(**preprocessor_overrides),
        processor() if processor is not None else None,
    )
