"""The vision tower and projector of a checkpoint, without its language model: what an encode
worker (`run_worker --role encode`) holds, and what an `llm` worker loads back on a fallback.

The model class is built on the meta device (no memory), its language model is dropped, and
only the vision parts are rebuilt and filled from the checkpoint's tensors, so the embeddings
come from the family's own `get_image_features` (Qwen2-VL's patch merger over its grid; LLaVA's
feature layer, projector and, for LLaVA-NeXT, the unpadded anyres tiles with their newline
features): exactly what the engine computes inside the whole model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash
from PIL import Image

from workers.processors import load_processor

if TYPE_CHECKING:
    import torch

# The inner model's attributes that make image features, per family; everything else (the
# language model, the LM head) is never loaded by an encoder.
VISION_PARTS: dict[str, tuple[str, ...]] = {
    "qwen2_vl": ("visual",),
    "qwen2_5_vl": ("visual",),
    "qwen3_vl": ("visual",),  # its tower holds the DeepStack mergers too
    "llava": ("vision_tower", "multi_modal_projector"),
    "llava_next": ("vision_tower", "multi_modal_projector", "image_newline"),
}
MROPE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})


class UnsupportedEncoderModel(ValueError):
    """A checkpoint whose family has no known vision parts."""


def processor_fingerprint(image_processor: Any) -> str:
    """The image processor's settings as one hash: other settings make other embeddings, so it is
    part of every embedding cache key (the engine computes the same)."""
    settings = json.dumps(image_processor.to_dict(), sort_keys=True, default=str)
    return xxhash.xxh3_64_hexdigest(settings.encode())


@dataclass(frozen=True)
class EncodedImage:
    # (placeholder tokens, text hidden size); Qwen3-VL: each row followed by its DeepStack features
    # (hidden size each), as the engine's model runner packs them.
    embedding: torch.Tensor
    grid_thw: tuple[int, int, int] | None  # Qwen's patch grid; None for LLaVA's tiles


class VisionEncoder:
    """Image → the rows the language model takes in place of the image's placeholder tokens."""

    def __init__(self, *, vision_model: Any, processor: Any, model_type: str, device: str) -> None:
        import torch

        self.vision_model = vision_model  # the family's inner model, vision parts only
        self.processor = processor
        self.image_processor = processor.image_processor
        self.model_type = model_type
        self.uses_mrope = model_type in MROPE_MODEL_TYPES
        self.device = torch.device(device)
        self.processor_fingerprint = processor_fingerprint(self.image_processor)
        # Qwen3-VL feeds features of several tower layers to the first decoder layers (DeepStack).
        vision_config = getattr(vision_model.config, "vision_config", None)
        self.deepstack = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())

    @classmethod
    def load(cls, model_dir: Path, *, device: str = "cpu") -> VisionEncoder:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText

        model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        if config.model_type not in VISION_PARTS:
            raise UnsupportedEncoderModel(
                f"no vision parts known for model type {config.model_type!r} "
                f"(encode workers serve {', '.join(sorted(VISION_PARTS))})"
            )
        dtype = torch.float32 if torch.device(device).type == "cpu" else _checkpoint_dtype(config)
        with torch.device("meta"):
            whole = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        inner = whole.model
        del inner.language_model  # on the meta device it held no memory; now it is not there at all
        load_vision_parts(inner, model_dir, device=device, dtype=dtype)
        inner.eval()
        return cls(
            vision_model=inner,
            processor=load_processor(model_dir),
            model_type=config.model_type,
            device=device,
        )

    @property
    def vision_module(self) -> torch.nn.Module:
        """The tower itself (a forward hook here counts encoder runs)."""
        return vision_tower(self.vision_model, self.model_type)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.vision_model.parameters())

    def encode(self, image: Image.Image) -> EncodedImage:
        import torch

        features = self.image_processor(images=[image], return_tensors="pt")
        with torch.inference_mode():
            if self.uses_mrope:
                grid = features["image_grid_thw"]
                output = self.vision_model.get_image_features(
                    features["pixel_values"].to(self.device), grid.to(self.device), return_dict=True
                )
                embedding = output.pooler_output[0]
                if self.deepstack:
                    embedding = torch.cat(
                        [embedding, *(layer[0] for layer in output.deepstack_features)], dim=-1
                    )
                return EncodedImage(embedding, tuple(int(n) for n in grid[0]))  # type: ignore[arg-type]
            pixels = {
                name: features[name].to(self.device)
                for name in ("pixel_values", "image_sizes")
                if name in features
            }
            output = self.vision_model.get_image_features(**pixels, return_dict=True)
            return EncodedImage(output.pooler_output[0], None)


def vision_tower(inner_model: Any, model_type: str) -> torch.nn.Module:
    return getattr(inner_model, VISION_PARTS[model_type][0])


def load_vision_parts(inner_model: Any, model_dir: Path, *, device: str, dtype: Any) -> None:
    """Rebuilds the family's vision parts of `inner_model` and fills them from the checkpoint.

    Only the vision tensors are read. Parts are rebuilt (not materialised from the meta device)
    so that buffers a checkpoint does not hold, like rotary frequencies, are computed as usual.
    """
    import torch

    model_type = inner_model.config.model_type
    tensors = _read_tensors(Path(model_dir), VISION_PARTS[model_type])
    for part in VISION_PARTS[model_type]:
        current = getattr(inner_model, part)
        own = {name[len(part) + 1 :]: t for name, t in tensors.items() if name.startswith(f"{part}.")}
        if isinstance(current, torch.nn.Parameter):  # LLaVA-NeXT's image_newline
            if part not in tensors:
                raise ValueError(f"{model_dir} holds no {part} tensor")
            setattr(
                inner_model, part, torch.nn.Parameter(tensors[part].to(device, dtype), requires_grad=False)
            )
            continue
        rebuilt = _rebuild(current, inner_model.config, dtype).to(device)
        missing, unexpected = rebuilt.load_state_dict(
            {name: t.to(dtype) for name, t in own.items()}, strict=False
        )
        persistent = {name for name, _ in rebuilt.state_dict().items()}
        missing = [name for name in missing if name in persistent]
        if missing or unexpected:
            raise ValueError(
                f"{model_dir}: the checkpoint's {part} tensors do not fit the model "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        rebuilt.eval()
        setattr(inner_model, part, rebuilt)


def _rebuild(meta_module: Any, config: Any, dtype: Any) -> Any:
    from transformers import PreTrainedModel

    if isinstance(meta_module, PreTrainedModel):
        # The same class on its own config: Qwen's tower with its mergers, LLaVA's CLIP tower.
        return type(meta_module)._from_config(meta_module.config, dtype=dtype)
    return type(meta_module)(config).to(dtype)  # LLaVA's projector takes the whole config


def _read_tensors(model_dir: Path, parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of these parts, named from the part down. Checkpoints name them
    either as the module tree does (`model.visual.…`) or in the published layout (`visual.…`)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        single = model_dir / "model.safetensors"
        if not single.is_file():
            raise FileNotFoundError(f"{model_dir} has no safetensors weights")
        with safe_open(str(single), "pt") as handle:
            weight_map = {name: single.name for name in handle.keys()}  # noqa: SIM118 (not a dict)

    wanted: dict[str, str] = {}  # checkpoint name → name from the part down
    for name in weight_map:
        bare = name.removeprefix("model.")
        if any(bare == part or bare.startswith(f"{part}.") for part in parts):
            wanted[name] = bare
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted({weight_map[name] for name in wanted}):
        with safe_open(str(model_dir / shard), "pt") as handle:
            for name, bare in wanted.items():
                if weight_map[name] == shard:
                    tensors[bare] = handle.get_tensor(name)
    return tensors


def _checkpoint_dtype(config: Any) -> Any:
    import torch

    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    return dtype or torch.float32
