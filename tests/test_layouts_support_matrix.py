"""The rest of the seed's support matrix: Llama 4, Kimi K2.5/K2.6, Qwen3.5/Qwen3.6 (dense and MoE)
and Nemotron 3 Nano Omni images, held to transformers' own code.

The published settings of each family's real checkpoint are embedded in tests/model_configs.py,
with where the code search found them. For each family, 1,000+ seeded sizes (log-uniform from
1 to 8000 per side, so tiny, huge and very elongated images all come up, plus fixed extremes):
the router's count equals the count transformers' code gives, and a size one refuses the other
refuses.

Oracles, all transformers' own functions called directly:
- Qwen3.5 / Qwen3.6: the image processor loaded from the checkpoint directory (its PIL backend
  runs here): `get_number_of_image_patches`, refusals, real images; the full Qwen3VLProcessor
  for the text + two images prompt.
- Llama 4, Kimi K2.5, Nemotron Omni: their image processors exist only for torchvision, which
  cannot be installed beside the CPU torch. `torchvision_import_shim_for_sizing_functions`
  (TEST-ONLY IMPORT SHIM) lets their modules import so that their sizing functions can be called
  (Llama 4's `find_supported_resolutions` / `get_best_fit`, Kimi's `navit_resize`, Nemotron's
  patch budget and `get_patch_grid_size`); the placeholder text comes from each processor's own
  `replace_image_token` and `get_text_with_replacements`, tokenized by the processor's tokenizer.
  Nothing that resizes pixels runs, and the shim is removed from `sys.modules` before any test
  body runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib
import io
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from routing.prompt.layouts import (
    ImageSizeRefused,
    KimiK25Layout,
    LayoutConfigError,
    Llama4Layout,
    NemotronOmniLayout,
    QwenVLLayout,
    layout_for_config,
    layout_for_model_dir,
)
from tests import model_configs
from tests.test_layouts import EXTREME_SIZES, random_sizes, real_image

QWEN3_5_FAMILIES = ["qwen3_5", "qwen3_5_moe"]
TORCHVISION_FAMILIES = ["llama4", "kimi_k25", "nemotron_h_omni"]
ALL_FAMILIES = [*QWEN3_5_FAMILIES, *TORCHVISION_FAMILIES]

# Sizes around the aspect-ratio bound and the tile/patch boundaries of these families.
BOUNDARY_SIZES = [
    (16, 3200),
    (16, 3201),
    (3201, 16),
    (32, 32),
    (31, 33),
    (336, 337),
    (672, 1008),
    (5376, 336),
    (7168, 7168),
    (7169, 14),
    (13, 7000),
    (28, 5600),
    (512, 512),
    (48, 32),
]


def sweep_sizes(seed: int) -> list[tuple[int, int]]:
    return EXTREME_SIZES + BOUNDARY_SIZES + random_sizes(seed=seed, count=1000)


# ----------------------------------------------------------------------------------------------
# The test-only import shim
# ----------------------------------------------------------------------------------------------

_SHIMMED = [
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
]
_SIZING_MODULES = {
    "llama4": "transformers.models.llama4.image_processing_llama4",
    "kimi_k25": "transformers.models.kimi_k25.image_processing_kimi_k25",
    "nemotron_h_omni": "transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni",
}


def torchvision_import_shim_for_sizing_functions() -> dict[str, types.ModuleType]:
    """TEST-ONLY IMPORT SHIM: transformers' torchvision-only image-processing modules, imported.

    Their module bodies do `from torchvision.transforms.v2 import functional as tvF` and nothing
    else with torchvision until pixels are resized. Empty stand-in modules satisfy that import;
    they are taken out of `sys.modules` again at once (and the imported modules detached from
    their packages), so no other code in the session sees a torchvision.
    """
    import transformers
    import transformers.image_processing_backends  # decides, before the shim, that torchvision is absent

    assert not transformers.utils.is_torchvision_available(), "torchvision is installed: no shim needed"
    saved = {name: sys.modules.get(name) for name in _SHIMMED}
    stand_ins = {name: types.ModuleType(name) for name in _SHIMMED}
    sys.modules.update(stand_ins)
    try:
        modules = {family: importlib.import_module(name) for family, name in _SIZING_MODULES.items()}
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name in _SIZING_MODULES.values():
            sys.modules.pop(name, None)
            package, _, attribute = name.rpartition(".")
            vars(sys.modules[package]).pop(attribute, None)
    return modules


@pytest.fixture(scope="module")
def sizing() -> dict[str, types.ModuleType]:
    return torchvision_import_shim_for_sizing_functions()


def processor_without_its_mixin_checks(processor_class: type, image_processor: Any, tokenizer: Any) -> Any:
    """The processor as its own __init__ sets it up (token names from the tokenizer), skipping
    ProcessorMixin's sub-processor type checks, which look up the torchvision-only video classes."""
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.__init__
    ProcessorMixin.__init__ = lambda self, *args, **kwargs: None
    try:
        processor = processor_class(image_processor=image_processor, tokenizer=tokenizer)
    finally:
        ProcessorMixin.__init__ = original
    processor.image_processor = image_processor
    processor.tokenizer = tokenizer
    return processor


def image_inputs_from_sizing_functions(
    family: str, sizing: dict[str, types.ModuleType], settings: dict[str, Any], sizes: list[tuple[int, int]]
) -> dict[str, Any]:
    """What the family's image processor would return for images of these sizes, but pixels:
    the shapes and grids its _preprocess derives, through the same transformers functions."""
    import torch
    from transformers.image_utils import SizeDict

    if family == "llama4":
        module = sizing["llama4"]
        tile = settings["size"]["height"]
        canvases = module.find_supported_resolutions(
            max_num_chunks=settings["max_patches"], patch_size=SizeDict(height=tile, width=tile)
        )
        ratios = []
        for width, height in sizes:
            canvas = module.get_best_fit(
                (height, width), torch.tensor(canvases), resize_to_max_canvas=settings["resize_to_max_canvas"]
            )
            ratios.append([int(canvas[0]) // tile, int(canvas[1]) // tile])
        return {"pixel_values": [torch.empty(1, 3, tile, tile)], "aspect_ratios": ratios}
    if family == "kimi_k25":
        module = sizing["kimi_k25"]
        patch = settings["patch_size"]
        grids = []
        for width, height in sizes:
            _, (padded_height, padded_width) = module.navit_resize(
                height,
                width,
                patch_size=patch,
                merge_kernel_size=settings["merge_size"],
                max_patches=settings["max_patches"],
                max_size_per_side=settings["size"]["max_height"],
            )
            grids.append([1, padded_height // patch, padded_width // patch])
        return {"image_grid_thw": torch.tensor(grids)}
    module = sizing["nemotron_h_omni"]
    budget = nemotron_patch_budget(sizing, settings, len(sizes))
    merge = round(1 / settings["downsample_ratio"])
    grids = [
        module.get_patch_grid_size(
            height, width, settings["patch_size"], merge, settings["min_num_patches"], budget
        )
        for width, height in sizes
    ]
    return {"image_grid_hw": torch.tensor(grids)}


class _BudgetSeen(Exception):
    pass


def nemotron_patch_budget(sizing: dict[str, types.ModuleType], settings: dict[str, Any], images: int) -> int:
    """The per-image patch budget Nemotron's _preprocess computes for a call with `images` images.

    Its own code runs up to the first get_patch_grid_size call, whose budget argument is caught.
    """
    import torch

    module = sizing["nemotron_h_omni"]
    processor = module.NemotronH_Omni_Reasoning_V3ImageProcessor(**image_processor_kwargs(settings))
    original = module.get_patch_grid_size

    def catch(height, width, patch_size, merge_size, min_num_patches, max_num_patches):
        raise _BudgetSeen(max_num_patches)

    module.get_patch_grid_size = catch
    try:
        processor._preprocess(
            [torch.zeros(3, 8, 8, dtype=torch.uint8)] * images,
            resample=processor.resample,
            do_rescale=True,
            rescale_factor=1 / 255,
            do_normalize=False,
            image_mean=None,
            image_std=None,
            patch_size=processor.patch_size,
            downsample_ratio=processor.downsample_ratio,
            min_num_patches=processor.min_num_patches,
            max_num_patches=processor.max_num_patches,
            max_model_len=processor.max_model_len,
            disable_grouping=True,
            return_tensors=None,
        )
    except _BudgetSeen as seen:
        return int(seen.args[0])
    finally:
        module.get_patch_grid_size = original
    raise AssertionError("the processor never sized a patch grid")


def image_processor_kwargs(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")}


# ----------------------------------------------------------------------------------------------
# Counts and refusals on 1,000+ sizes per family
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("support-matrix")
    return {family: model_configs.write_family_dir(root / family, family) for family in ALL_FAMILIES}


@pytest.mark.parametrize("model_type", QWEN3_5_FAMILIES)
def test_qwen3_5_counts_and_refusals_equal_the_processor_on_a_thousand_sizes(
    model_type: str, family_dirs: dict[str, Path]
) -> None:
    from transformers import AutoImageProcessor

    # given: Qwen3.5's (and Qwen3.6's) published settings, loaded by transformers
    processor = AutoImageProcessor.from_pretrained(family_dirs[model_type])
    layout = layout_for_model_dir(family_dirs[model_type])
    assert isinstance(layout, QwenVLLayout) and layout.patch_size == 16
    sizes = sweep_sizes(seed=35)
    refused = 0

    for width, height in sizes:
        # when
        try:
            patches = processor.get_number_of_image_patches(height, width)
        except ValueError:
            # then: what the processor refuses, the layout refuses
            with pytest.raises(ImageSizeRefused):
                layout.image_tokens(width, height)
            refused += 1
            continue
        # then
        assert layout.image_tokens(width, height) == patches // processor.merge_size**2, (width, height)

    assert len(sizes) >= 1000 and 10 < refused < len(sizes) // 2


@pytest.mark.parametrize("model_type", QWEN3_5_FAMILIES)
def test_qwen3_5_grid_equals_the_processor_output_on_real_images(
    model_type: str, family_dirs: dict[str, Path]
) -> None:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(family_dirs[model_type])
    layout = layout_for_model_dir(family_dirs[model_type])
    assert isinstance(layout, QwenVLLayout)
    sizes = [(1, 1), (5, 900), (48, 32), *random_sizes(seed=8, count=12, high=700)]

    for index, (width, height) in enumerate(s for s in sizes if max(s) / min(s) <= 200):
        grid = processor(real_image(width, height, seed=index), return_tensors="np")["image_grid_thw"][0]
        assert layout.grid_thw(width, height) == tuple(int(v) for v in grid), (width, height)


def test_llama4_layout_equals_the_processor_replacement_on_a_thousand_sizes(
    sizing: dict[str, types.ModuleType],
) -> None:
    from transformers import Llama4Processor

    # given: Llama 4's published settings
    settings = model_configs.llama4_preprocessor()
    layout = layout_for_config(model_configs.llama4_config(), settings, model_configs.llama4_processor())
    assert isinstance(layout, Llama4Layout) and layout.tokens_per_tile == 144
    image_processor = sizing["llama4"].Llama4ImageProcessor(**image_processor_kwargs(settings))
    tokenizer = word_tokenizer(layout.vocabulary)
    processor = Llama4Processor(image_processor, tokenizer, **processor_kwargs("llama4"))
    sizes = sweep_sizes(seed=4)

    # when
    inputs = image_inputs_from_sizing_functions("llama4", sizing, settings, sizes)

    # then: the placeholder becomes exactly the text the processor writes for it
    tiles_seen = set()
    for index, (width, height) in enumerate(sizes):
        expected = processor.replace_image_token(inputs, index)
        assert expansion_text(layout, width, height) == expected, (width, height)
        tiles_seen.add(layout.tile_grid(width, height))
    assert {(1, 1), (4, 4), (1, 16), (16, 1)} <= tiles_seen  # one tile, the square grid, both extremes


def test_llama4_resize_to_max_canvas_changes_the_grid_as_it_changes_the_processor(
    sizing: dict[str, types.ModuleType],
) -> None:
    settings = model_configs.llama4_preprocessor(resize_to_max_canvas=True, max_patches=6)
    layout = layout_for_config(model_configs.llama4_config(), settings, model_configs.llama4_processor())
    assert isinstance(layout, Llama4Layout)
    sizes = sweep_sizes(seed=5)

    inputs = image_inputs_from_sizing_functions("llama4", sizing, settings, sizes)

    assert [list(layout.tile_grid(w, h)) for w, h in sizes] == inputs["aspect_ratios"]


def test_kimi_k25_counts_equal_the_processor_on_a_thousand_sizes(sizing: dict[str, types.ModuleType]) -> None:
    from transformers import Kimi_K25Processor

    # given: Kimi K2.5's published settings
    settings = model_configs.kimi_k25_preprocessor()
    layout = layout_for_config(model_configs.kimi_k25_config(), settings)
    assert isinstance(layout, KimiK25Layout)
    image_processor = sizing["kimi_k25"].Kimi_K25ImageProcessor(**image_processor_kwargs(settings))
    processor = processor_without_its_mixin_checks(
        Kimi_K25Processor, image_processor, word_tokenizer(layout.vocabulary)
    )
    sizes = sweep_sizes(seed=25)

    # when: the processor's own count (what vLLM asks it), and its grids and placeholder text
    counted = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])["num_image_tokens"]
    inputs = image_inputs_from_sizing_functions("kimi_k25", sizing, settings, sizes)

    # then
    assert [layout.image_tokens(w, h) for w, h in sizes] == counted
    for index, (width, height) in enumerate(sizes):
        assert layout.grid(width, height) == tuple(int(v) for v in inputs["image_grid_thw"][index][1:])
        assert expansion_text(layout, width, height) == processor.replace_image_token(inputs, index)
    # both ends came up: the one-token floor, and the patch budget (padding may pass it a little)
    assert min(counted) == 1 and 16384 // 4 <= max(counted) < 16384 // 4 * 1.1


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the published settings
        # transformers' upstream processor test settings (tests/models/nemotron_h_omni/
        # test_processing_nemotron_h_omni.py): a tiny budget, where elongated images fail
        {"min_num_patches": 4, "max_num_patches": 16, "max_model_len": 1024},
    ],
    ids=["published", "upstream-test-settings"],
)
def test_nemotron_omni_counts_and_refusals_equal_the_processor_on_a_thousand_sizes(
    overrides: dict[str, Any], sizing: dict[str, types.ModuleType]
) -> None:
    import torch
    from transformers import NemotronH_Omni_Reasoning_V3Processor

    # given
    settings = model_configs.nemotron_omni_preprocessor(**overrides)
    layout = layout_for_config(model_configs.nemotron_omni_config(), settings)
    assert isinstance(layout, NemotronOmniLayout)
    module = sizing["nemotron_h_omni"]
    image_processor = module.NemotronH_Omni_Reasoning_V3ImageProcessor(**image_processor_kwargs(settings))
    processor = processor_without_its_mixin_checks(
        NemotronH_Omni_Reasoning_V3Processor, image_processor, word_tokenizer(layout.vocabulary)
    )
    budget = nemotron_patch_budget(sizing, settings, images=1)
    assert layout.patch_budget(1) == budget
    refused = 0

    for width, height in sweep_sizes(seed=3):
        # when
        try:
            grid = module.get_patch_grid_size(height, width, 16, 2, settings["min_num_patches"], budget)
        except ZeroDivisionError:
            # then: an image the processor cannot size, the layout refuses
            with pytest.raises(ImageSizeRefused, match="empty patch grid"):
                layout.image_tokens(width, height)
            refused += 1
            continue
        # then
        assert layout.grid(width, height) == grid, (width, height)
        inputs = {"image_grid_hw": torch.tensor([grid])}
        assert expansion_text(layout, width, height) == processor.replace_image_token(inputs, 0)

    assert (refused > 0) == bool(overrides)  # the published budget refuses no size up to 8000x8000


def test_nemotron_omni_budget_follows_the_number_of_images_as_the_processor_does(
    sizing: dict[str, types.ModuleType],
) -> None:
    # given: a short context and no cap, where each image's budget grows with the image count
    settings = model_configs.nemotron_omni_preprocessor(max_num_patches=0, max_model_len=260)
    layout = layout_for_config(model_configs.nemotron_omni_config(), settings)
    assert isinstance(layout, NemotronOmniLayout)

    budgets = [nemotron_patch_budget(sizing, settings, images=n) for n in (1, 2, 3)]

    assert [layout.patch_budget(n) for n in (1, 2, 3)] == budgets == [1024, 2048, 3072]
    assert layout.image_tokens(4000, 3000, images_in_prompt=1) < layout.image_tokens(4000, 3000, 3)


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_a_side_under_one_pixel_is_refused(model_type: str, family_dirs: dict[str, Path]) -> None:
    layout = layout_for_model_dir(family_dirs[model_type])
    assert layout is not None
    for width, height in [(0, 10), (10, 0), (-5, 5)]:
        with pytest.raises(ImageSizeRefused, match=rf"{width}x{height} has a side under 1 pixel"):
            layout.image_tokens(width, height)


# ----------------------------------------------------------------------------------------------
# Settings transformers refuses are refused when the layout is read
# ----------------------------------------------------------------------------------------------

QWEN_SIZE_VARIANTS = [
    ({"size": {"longest_edge": 1_000_000}}, False),
    ({"size": {"shortest_edge": 1000}}, False),
    ({"size": {"min_pixels": 1000, "max_pixels": 1_000_000}}, False),
    ({"size": {"min_pixels": 1000, "max_pixels": 1_000_000}, "min_pixels": 3000}, False),
    ({"size": {"longest_edge": 1_000_000}, "min_pixels": 3000}, True),
    (
        {"size": {"min_pixels": 1000, "max_pixels": 1_000_000}, "min_pixels": 3000, "max_pixels": 2_000_000},
        True,
    ),
    ({"size": {"height": 448, "width": 448}}, False),
    ({"size": {"shortest_edge": 3136, "longest_edge": 1_003_520}}, True),
    ({"min_pixels": 50_000}, True),
    ({}, True),  # the processor class defaults
]


@pytest.mark.parametrize(("settings", "served"), QWEN_SIZE_VARIANTS)
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_a_partial_size_dict_transformers_refuses_is_refused_when_the_layout_is_read(
    model_type: str, settings: dict[str, Any], served: bool
) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    preprocessor = {"patch_size": 16, "merge_size": 2, **settings}
    config = {"model_type": model_type}

    # the oracle: does transformers' processor serve an image with these settings at all?
    try:
        Qwen2VLImageProcessorPil(**settings)(real_image(64, 48, seed=0), return_tensors="np")
        transformers_serves = True
    except ValueError:
        transformers_serves = False
    assert transformers_serves is served

    if served:
        layout = layout_for_config(config, preprocessor)
        assert layout is not None
        expected = Qwen2VLImageProcessorPil(**preprocessor).get_number_of_image_patches(480, 640) // 4
        assert layout.image_tokens(640, 480) == expected
    else:
        with pytest.raises(
            LayoutConfigError, match="must settle to exactly 'shortest_edge' and 'longest_edge'"
        ):
            layout_for_config(config, preprocessor)


@pytest.mark.parametrize(
    ("model_type", "preprocessor", "reason"),
    [
        ("llama4", {"size": {"height": 336, "width": 448}}, "must be square"),
        ("llama4", {"do_resize": False}, "always resizes"),
        ("kimi_k25", {"size": {"max_height": 512, "max_width": 256}}, "identical values"),
        ("kimi_k25", {"media_proc_cfg": {"in_patch_limit": 65536}}, "media_proc_cfg disagrees"),
        ("nemotron_h_omni", {"downsample_ratio": 0}, "downsample_ratio"),
    ],
)
def test_settings_the_family_processor_refuses_are_refused_with_the_reason(
    model_type: str, preprocessor: dict[str, Any], reason: str
) -> None:
    with pytest.raises(LayoutConfigError, match=reason):
        layout_for_config({"model_type": model_type}, preprocessor)


def test_the_frontend_refuses_to_start_on_such_settings_with_a_clear_message(tmp_path: Path) -> None:
    # given: a Qwen3.5 checkpoint whose size holds only longest_edge
    directory = model_configs.write_family_dir(
        tmp_path / "qwen3_5-bad", "qwen3_5", size={"longest_edge": 10**6}
    )
    env = {
        **os.environ,
        "MODEL_PATH": str(directory),
        "DJANGO_SETTINGS_MODULE": "inference_platform.settings",
    }

    # when: the ASGI application (what uvicorn loads) is imported
    started = subprocess.run(
        [sys.executable, "-c", "import inference_platform.asgi"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )

    # then
    assert started.returncode != 0
    assert "ImproperlyConfigured" in started.stderr
    assert "cannot be routed" in started.stderr and "'shortest_edge' and 'longest_edge'" in started.stderr


# ----------------------------------------------------------------------------------------------
# The token view equals the processor's input ids for a text + two images prompt
# ----------------------------------------------------------------------------------------------

# Each family's chat template reduced to what these tests send (text and image parts), with the
# image markup of the family's published template.
TEMPLATES = {
    "qwen3_5": ("<|im_start|>{role}\n", "<|im_end|>\n", "<|vision_start|><|image_pad|><|vision_end|>"),
    "llama4": ("<|header_start|>{role}<|header_end|>\n\n", "<|eot|>", "<|image|>"),
    "kimi_k25": (
        "<|im_{role}|>{role}<|im_middle|>",
        "<|im_end|>",
        "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>",
    ),
    "nemotron_h_omni": ("<|im_start|>{role}\n", "<|im_end|>\n", "<image>"),
}
TEMPLATES["qwen3_5_moe"] = TEMPLATES["qwen3_5"]
SPECIAL_TOKENS = {
    "qwen3_5": [
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
    "llama4": [
        "<|begin_of_text|>",
        "<|header_start|>",
        "<|header_end|>",
        "<|eot|>",
        "<|image|>",
        "<|image_start|>",
        "<|image_end|>",
        "<|patch|>",
        "<|tile_x_separator|>",
        "<|tile_y_separator|>",
    ],
    "kimi_k25": [
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<|media_begin|>",
        "<|media_content|>",
        "<|media_end|>",
        "<|media_pad|>",
    ],
    "nemotron_h_omni": ["<|im_start|>", "<|im_end|>", "<image>", "<img>", "</img>"],
}
SPECIAL_TOKENS["qwen3_5_moe"] = SPECIAL_TOKENS["qwen3_5"]
CONFIG_IMAGE_TOKEN = {  # (config key, the token whose id it holds) as in the published configs
    "qwen3_5": ("image_token_id", "<|image_pad|>"),
    "qwen3_5_moe": ("image_token_id", "<|image_pad|>"),
    "llama4": ("image_token_index", "<|patch|>"),
    "kimi_k25": ("image_token_id", "<|media_pad|>"),
    "nemotron_h_omni": ("img_context_token_id", "<image>"),
}


def chat_template(model_type: str) -> str:
    opening, closing, image = TEMPLATES[model_type]
    opening = opening.replace("{role}", "{{ message['role'] }}")
    generation = TEMPLATES[model_type][0].replace("{role}", "assistant")
    return (
        "{{ bos_token }}{% for message in messages %}" + opening + "{% if message['content'] is string %}"
        "{{ message['content'] }}{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}" + image + "{% elif item['type'] == 'text' %}{{ item['text'] }}"
        "{% endif %}{% endfor %}{% endif %}" + closing + "{% endfor %}"
        "{% if add_generation_prompt %}" + generation + "{% endif %}"
    )


def build_family_checkpoint(path: Path, model_type: str) -> Path:
    """A checkpoint without weights: config and image settings as published, a locally trained
    tokenizer holding the family's special tokens, and the family's chat template (reduced)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "</s>", *SPECIAL_TOKENS[model_type]]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["You compare pictures. Here is the first picture: and the second one: which is redder?"] * 40
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[model_type]})
    config, preprocessor, processor = model_configs.FAMILIES[model_type]
    config_json = config()
    key, token = CONFIG_IMAGE_TOKEN[model_type]
    config_json[key] = backend.token_to_id(token)
    model_configs.write_model_dir(path, config_json, preprocessor(), processor() if processor else None)
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(chat_template(model_type))
    return path


def word_tokenizer(tokens: tuple[str, ...]) -> Any:
    """A tokenizer that knows the layout's tokens, for processors that only need their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(["<unk>", *tokens])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tokenizer


def processor_kwargs(model_type: str) -> dict[str, Any]:
    _, _, processor = model_configs.FAMILIES[model_type]
    settings = processor() if processor else {}
    settings.pop("processor_class", None)
    return settings


def expansion_text(layout: Any, width: int, height: int, images_in_prompt: int = 1) -> str:
    return "".join(token * count for token, count in layout.expansion(width, height, images_in_prompt))


def png_data_url(width: int, height: int, colour: tuple[int, int, int]) -> str:
    import base64

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def two_image_request(model: str, first: str, second: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "You compare pictures."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here is the first picture:"},
                    {"type": "image_url", "image_url": {"url": first}},
                    {"type": "text", "text": "and the second one:"},
                    {"type": "image_url", "image_url": {"url": second}},
                    {"type": "text", "text": "Which is redder?"},
                ],
            },
        ],
    }


TWO_IMAGES = [((640, 480), (200, 30, 30)), ((123, 457), (10, 200, 10))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("support-matrix-checkpoints")
    return {family: build_family_checkpoint(root / family, family) for family in ALL_FAMILIES}


def processor_input_ids(
    model_type: str, directory: Path, prompt: str, sizing: dict[str, types.ModuleType]
) -> list[int]:
    """The family's processor's input_ids for this prompt and the two images.

    Qwen3.5 runs whole. The others lay the prompt out with their own replace_image_token and
    get_text_with_replacements from the sizing functions' image inputs (their pixel step needs
    torchvision), and tokenize it with their tokenizer.
    """
    from transformers import AutoTokenizer

    if model_type in QWEN3_5_FAMILIES:
        from routing.prompt.processor_view import processor_for

        images = [Image.new("RGB", size, colour) for size, colour in TWO_IMAGES]
        outputs = processor_for(directory)(text=[prompt], images=images, return_tensors="pt")
        return outputs["input_ids"][0].tolist()

    from transformers import Kimi_K25Processor, Llama4Processor, NemotronH_Omni_Reasoning_V3Processor

    tokenizer = AutoTokenizer.from_pretrained(directory)
    settings = json.loads((directory / "preprocessor_config.json").read_text())
    sizes = [size for size, _ in TWO_IMAGES]
    inputs = image_inputs_from_sizing_functions(model_type, sizing, settings, sizes)
    module = sizing[model_type]
    if model_type == "llama4":
        image_processor = module.Llama4ImageProcessor(**image_processor_kwargs(settings))
        processor = Llama4Processor(image_processor, tokenizer, **processor_kwargs(model_type))
    elif model_type == "kimi_k25":
        image_processor = module.Kimi_K25ImageProcessor(**image_processor_kwargs(settings))
        processor = processor_without_its_mixin_checks(Kimi_K25Processor, image_processor, tokenizer)
    else:
        image_processor = module.NemotronH_Omni_Reasoning_V3ImageProcessor(**image_processor_kwargs(settings))
        processor = processor_without_its_mixin_checks(
            NemotronH_Omni_Reasoning_V3Processor, image_processor, tokenizer
        )
    replacements = [processor.replace_image_token(inputs, index) for index in range(len(sizes))]
    text, _ = processor.get_text_with_replacements([prompt], images_replacements=replacements)
    return tokenizer(text)["input_ids"][0]


@pytest.mark.django_db
@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_token_view_equals_the_processors_input_ids_for_text_and_two_images(
    model_type: str, checkpoints: dict[str, Path], sizing: dict[str, types.ModuleType], settings: Any
) -> None:
    from inference_platform.api.chat_request import parse_chat_request
    from inference_platform.serving.prepare import prepare

    # given: the family's checkpoint served, and a request with text and two images
    directory = checkpoints[model_type]
    settings.MODEL_PATH = directory
    settings.MODEL_NAME = ""
    settings.DYN_MM_FRONTEND_DECODING = False
    urls = [png_data_url(*size, colour) for size, colour in TWO_IMAGES]
    chat = parse_chat_request(two_image_request(model_type, *urls), max_tokens_limit=64)

    # when
    prepared = prepare(chat)

    # then: the router sees the prompt exactly as the processor lays it out
    expected = processor_input_ids(model_type, directory, prepared.prompt, sizing)
    assert prepared.view.fallback is None
    assert prepared.view.tokens == expected
    described = prepared.describe()
    assert described["family"] == model_configs_family_name(model_type)
    assert described["count_source"] == "registry"
    assert [i["count_source"] for i in described["images"]] == ["registry", "registry"]
    # each image's span covers what its placeholder became, and nothing of the text around it
    layout = layout_for_model_dir(directory)
    assert layout is not None
    for image, (size, _) in zip(prepared.view.images, TWO_IMAGES, strict=True):
        assert image.tokens == layout.image_tokens(*size, images_in_prompt=2)
        span = expected[image.start : image.start + image.tokens]
        assert span.count(prepared.model.image_placeholder_id) >= 1


def model_configs_family_name(model_type: str) -> str:
    return {
        "qwen3_5": "Qwen3.5",
        "qwen3_5_moe": "Qwen3.5-MoE / Qwen3.6",
        "llama4": "Llama 4",
        "kimi_k25": "Kimi K2.5 / K2.6",
        "nemotron_h_omni": "Nemotron 3 Nano Omni",
    }[model_type]


@pytest.mark.django_db
@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_the_processor_path_serves_each_family_exactly(
    model_type: str, checkpoints: dict[str, Path], settings: Any
) -> None:
    from inference_platform.api.chat_request import parse_chat_request
    from inference_platform.serving.prepare import prepare

    # given
    settings.MODEL_PATH = checkpoints[model_type]
    settings.MODEL_NAME = ""
    settings.DYN_MM_FRONTEND_DECODING = False
    urls = [png_data_url(*size, colour) for size, colour in TWO_IMAGES]
    chat = parse_chat_request(two_image_request(model_type, *urls), max_tokens_limit=64)
    registry = prepare(chat)

    # when: DYN_CHAT_PROCESSOR=transformers
    settings.DYN_CHAT_PROCESSOR = "transformers"
    processed = prepare(chat)

    # then: the same exact view; counted by the processor where it runs here (Qwen3.5), by the
    # registry layout where it needs torchvision (Llama 4, Kimi K2.5, Nemotron Omni)
    assert processed.view.fallback is None
    assert processed.view.tokens == registry.view.tokens
    if model_type in QWEN3_5_FAMILIES:
        assert processed.describe()["count_source"] == "transformers processor"
        assert processed.view.block_hashes == registry.view.block_hashes
        assert processed.processed is not None and processed.processed["input_ids"] == registry.view.tokens
    else:
        assert processed.describe()["count_source"] == "registry"
        assert processed.processed is None


@pytest.mark.django_db
def test_inspect_request_names_the_family_and_the_source_of_each_count(
    checkpoints: dict[str, Path], settings: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from django.core.management import call_command

    settings.MODEL_PATH = checkpoints["llama4"]
    settings.MODEL_NAME = ""
    settings.DYN_MM_FRONTEND_DECODING = False
    body = two_image_request("llama4", *(png_data_url(*size, colour) for size, colour in TWO_IMAGES))
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))

    call_command("inspect_request", str(path))

    printed = capsys.readouterr().out
    assert "family         Llama 4" in printed
    assert "image counts   registry" in printed
    layout = layout_for_model_dir(checkpoints["llama4"])
    assert layout is not None
    tokens = layout.image_tokens(640, 480)  # a 2x2 canvas: four tiles and the global one
    assert f"640x480  {tokens} tokens at" in printed and "(registry)" in printed


@pytest.mark.django_db(transaction=True)
async def test_the_route_endpoint_names_the_family_and_the_source_of_each_count(
    checkpoints: dict[str, Path], settings: Any, api_headers: dict[str, str]
) -> None:
    from tests.api_client import KeyedAsyncClient

    # given: Nemotron Omni served, whose images are wrapped in <img>...</img>
    settings.MODEL_PATH = checkpoints["nemotron_h_omni"]
    settings.MODEL_NAME = ""
    settings.DYN_MM_FRONTEND_DECODING = False
    body = two_image_request("nemotron_h_omni", *(png_data_url(*size, colour) for size, colour in TWO_IMAGES))

    # when
    response = await KeyedAsyncClient(api_headers).post(
        "/v1/route", data=json.dumps(body), content_type="application/json"
    )

    # then
    assert response.status_code == 200, response.content
    described = json.loads(response.content)
    assert described["family"] == "Nemotron 3 Nano Omni"
    assert described["count_source"] == "registry"
    layout = layout_for_model_dir(checkpoints["nemotron_h_omni"])
    assert layout is not None
    assert [(i["tokens"], i["count_source"]) for i in described["images"]] == [
        (layout.image_tokens(*size, images_in_prompt=2), "registry") for size, _ in TWO_IMAGES
    ]


def test_kimi_published_media_proc_cfg_agrees_with_what_transformers_reads() -> None:
    # The published checkpoint keeps its limits in media_proc_cfg (for its remote code); those
    # values are the ones transformers' class uses, so the layout is the same either way.
    published = {
        "media_proc_cfg": {
            "in_patch_limit": 16384,
            "patch_size": 14,
            "merge_kernel_size": 2,
            "patch_limit_on_one_side": 512,
            "fixed_output_tokens": None,
        }
    }
    config = model_configs.kimi_k25_config()
    native = layout_for_config(config, model_configs.kimi_k25_preprocessor())
    assert layout_for_config(config, published) == native


def test_a_tokenizer_without_the_layouts_marker_tokens_stops_the_start_up(
    checkpoints: dict[str, Path], settings: Any, tmp_path: Path
) -> None:
    import shutil

    from django.core.exceptions import ImproperlyConfigured

    from inference_platform.serving.prepare import check_served_model

    # given: Llama 4's settings beside a tokenizer that knows none of its image tokens
    directory = tmp_path / "llama4-without-its-tokens"
    shutil.copytree(checkpoints["nemotron_h_omni"], directory)
    model_configs.write_model_dir(
        directory,
        model_configs.llama4_config(),
        model_configs.llama4_preprocessor(),
        model_configs.llama4_processor(),
    )
    settings.MODEL_PATH = directory
    settings.MODEL_NAME = ""

    # when / then
    with pytest.raises(ImproperlyConfigured, match=r"no '<\|image_start\|>' token"):
        check_served_model()
    # and the served checkpoints themselves pass
    settings.MODEL_PATH = checkpoints["llama4"]
    check_served_model()


def test_nemotron_omni_single_image_counts_equal_dynamos_vllm_goldens() -> None:
    # An independent cross-check: the vLLM 0.28 dynamic-resolution counts that Dynamo's own
    # router is tested against (ai-dynamo/dynamo, lib/llm/src/preprocessor/mm_routing/nemotron.rs,
    # counts_match_vllm_0_28_dynamic_resolution_goldens), one image under the full 13312 budget.
    # They exclude the <img> and </img> the transformers processor wraps each image in.
    published = model_configs.nemotron_omni_preprocessor()
    layout = layout_for_config(model_configs.nemotron_omni_config(), published)
    assert isinstance(layout, NemotronOmniLayout)
    goldens = {
        (224, 224): 256,
        (64, 32): 276,
        (512, 512): 256,
        (1000, 500): 512,
        (500, 1000): 512,
        (1024, 1024): 1024,
        (1536, 1536): 2304,
        (1920, 1080): 2040,
    }

    assert {size: layout.image_tokens(*size) - 2 for size in goldens} == goldens


def test_llama4_image_token_setting_moves_the_placeholder_not_the_inner_image_token(
    sizing: dict[str, types.ModuleType],
) -> None:
    from transformers import Llama4Processor

    # given: a processor_config.json naming another image token for the template to emit
    settings = model_configs.llama4_preprocessor()
    processor_settings = model_configs.llama4_processor(image_token="<image>", fake_image_token="<image>")
    layout = layout_for_config(model_configs.llama4_config(), settings, processor_settings)
    assert isinstance(layout, Llama4Layout) and layout.placeholder_token == "<image>"
    image_processor = sizing["llama4"].Llama4ImageProcessor(**image_processor_kwargs(settings))
    kwargs = {k: v for k, v in processor_settings.items() if k != "processor_class"}
    processor = Llama4Processor(image_processor, word_tokenizer(layout.vocabulary), **kwargs)
    inputs = image_inputs_from_sizing_functions("llama4", sizing, settings, [(900, 500)])

    # when: the processor lays out a prompt holding that token
    text, _ = processor.get_text_with_replacements(
        ["look <image> here"], images_replacements=[processor.replace_image_token(inputs, 0)]
    )

    # then: the layout's expansion replaced the placeholder, its inner <|image|> untouched
    assert text == [f"look {expansion_text(layout, 900, 500)} here"]
    assert "<|image|>" in layout.vocabulary and layout.vocabulary[0] == "<image>"
