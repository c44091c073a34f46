"""Loads a checkpoint's processor (tokenizer plus image processor) for the Qwen2-VL, Qwen3-VL and
LLaVA families, offline and without torchvision (videos: workers.video_inputs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from routing.prompt.processor_view import images_only


def load_processor(model_dir: Path) -> Any:
    """The Qwen2-VL or LLaVA family processor of a checkpoint directory, built without torchvision.

    Qwen: ``AutoProcessor`` needs the video processor, which needs torchvision; without it it
    silently returns only the tokenizer (ENGINE-NOTES trap 1). Images only: the PIL image processor
    and the tokenizer in the family's processor class, with no video processor. LLaVA-1.5 and
    LLaVA-NeXT processors have no video processor, and their image processors have PIL backends.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") in _LLAVA_PROCESSORS:
        return _load_llava_processor(model_dir, config["model_type"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    processor_class = _processor_class(config.get("model_type", ""))
    return processor_class(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
    )


def _processor_class(model_type: str) -> Any:
    from transformers import Qwen2VLProcessor

    if model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor

        base = Qwen2_5_VLProcessor
    elif model_type == "qwen2_vl":
        base = Qwen2VLProcessor
    elif model_type == "qwen3_vl":
        from transformers import Qwen3VLProcessor

        base = Qwen3VLProcessor
    else:
        raise ValueError(f"no image processor known for model type {model_type!r}")
    return images_only(base)


_LLAVA_PROCESSORS = {"llava": "LlavaProcessor", "llava_next": "LlavaNextProcessor"}


def _load_llava_processor(model_dir: Path, model_type: str) -> Any:
    import transformers

    processor_class = getattr(transformers, _LLAVA_PROCESSORS[model_type])
    # The family's class, not AutoProcessor: a checkpoint whose processor files are missing must
    # fail here rather than serve with a bare tokenizer that cannot expand images.
    processor = processor_class.from_pretrained(model_dir)
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{model_dir} has no image processor settings")
    return processor
