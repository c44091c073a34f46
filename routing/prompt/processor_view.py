"""The token view from the model's own multimodal processor, for any family transformers supports.

The alternative to the layout registry (the seed's "Python chat processor" path): the frontend
runs the checkpoint's transformers processor, routes on its exact input ids and image spans, and
hands the processed inputs to the worker, which then skips its own preprocessing. transformers
(and torch) are imported only when this path is used, so the web process stays light otherwise.

Where each image lies in the processor's input ids, in order of preference:
- the processor's own replacement offsets (`return_text_replacement_offsets`, which every
  processor on transformers' generic multimodal `__call__` reports) mapped onto token offsets:
  an image's span runs from its first to its last image token, so an image that becomes several
  runs (Gemma 3's pan-and-scan crops, Idefics3/SmolVLM tiles, Pixtral rows) is still one span;
- otherwise, when every image became exactly one run of image tokens, run n is image n.
Anything else raises UnsupportedProcessorLayout, and the caller routes on the text prefix.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from routing.prompt.token_view import ImageFacts, ImageInView, TokenView

if TYPE_CHECKING:
    from PIL import Image

# What this module asks the processor for only to locate the images; the worker never needs it.
_LOCATING_KEYS = ("offset_mapping", "text_replacement_offsets")


class UnsupportedProcessorLayout(ValueError):
    """The processor's output does not say which image tokens belong to which image."""


@dataclass(frozen=True)
class ProcessorView:
    view: TokenView
    processed: dict[str, Any]  # JSON-safe processed inputs for the worker (see encode_processed)


@dataclass(frozen=True)
class _CannotLoad:
    reason: str


_processors: dict[Path, Any] = {}
_processors_lock = threading.Lock()


def processor_for(model_dir: Path) -> Any:
    """The checkpoint's multimodal processor, loaded once per model directory."""
    key = Path(model_dir).resolve()
    with _processors_lock:
        # Loading under the lock: concurrent first requests wait for one load instead of racing.
        processor = _processors.get(key)
        if processor is None:
            try:
                processor = _load_processor(key)
            except UnsupportedProcessorLayout as exc:
                # Remembered, so a processor that cannot load here is not retried on every request.
                processor = _CannotLoad(str(exc))
            _processors[key] = processor
        if isinstance(processor, _CannotLoad):
            raise UnsupportedProcessorLayout(processor.reason)  # a fresh one: no traceback piles up
        return processor


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _load_processor(model_dir: Path) -> Any:
    # Offline always: the model directory is all there is, and a hub lookup would stall a request.
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_dir)
    except (ImportError, ValueError, OSError):
        # Families with a video processor (Qwen2-VL, LLaVA-OneVision, SmolVLM, ...) need
        # torchvision for it, which may not be installed; the images need none of it. A family
        # AutoProcessor does not know is refused below, by name.
        processor = None
    if processor is None or getattr(processor, "image_processor", None) is None:
        # Without torchvision AutoProcessor may also return the bare tokenizer, silently.
        try:
            processor = _images_only_processor_class(model_dir).from_pretrained(model_dir)
        except (ImportError, ValueError) as exc:
            # Llama 4's, Kimi K2.5's and Nemotron Omni's image processors exist only for
            # torchvision, which this deployment lacks (transformers says so with either error):
            # their registry layouts serve instead.
            raise UnsupportedProcessorLayout(
                f"the model's image processor cannot load here ({str(exc).strip().splitlines()[0]})"
            ) from exc
    return processor


_IMAGES_ONLY_CLASSES: dict[type, type] = {}


def _images_only_processor_class(model_dir: Path) -> type:
    """The family's processor class (from the checkpoint's files) with its video processor left out."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = str(_read_json(model_dir / "config.json").get("model_type", ""))
    name = (
        _read_json(model_dir / "processor_config.json").get("processor_class")
        or _read_json(model_dir / "preprocessor_config.json").get("processor_class")
        or PROCESSOR_MAPPING_NAMES.get(model_type)
    )
    base = getattr(transformers, str(name), None) if name else None
    if base is None:
        raise UnsupportedProcessorLayout(
            f"transformers has no multimodal processor for model type {model_type!r}"
        )
    return images_only(base)


def images_only(base: type) -> type:
    """`base`, a processor class, without its video processor.

    ProcessorMixin takes its sub-processors from the `__init__` signature, so a subclass whose
    `__init__` names only the image processor and the tokenizer loads without torchvision
    (which cannot be installed beside the CPU torch wheel).
    """
    if base not in _IMAGES_ONLY_CLASSES:

        def __init__(
            self: Any,
            image_processor: Any = None,
            tokenizer: Any = None,
            chat_template: Any = None,
            **kwargs: Any,
        ) -> None:
            base.__init__(
                self,
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=None,
                chat_template=chat_template,
                **kwargs,
            )

        _IMAGES_ONLY_CLASSES[base] = type(f"{base.__name__}ImagesOnly", (base,), {"__init__": __init__})
    return _IMAGES_ONLY_CLASSES[base]


def image_token_id(processor: Any, config: Mapping[str, Any]) -> int:
    """The id of the token the processor repeats for an image's features."""
    for key in ("image_token_id", "image_token_index"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    # Gemma 3's processor calls its begin-of-image marker `image_token_id`; the ids it lists as
    # image tokens are the feature tokens, so they come first.
    listed = getattr(processor, "image_token_ids", None)
    if isinstance(listed, list) and len(listed) == 1 and isinstance(listed[0], int):
        return listed[0]
    value = getattr(processor, "image_token_id", None)
    if isinstance(value, int):
        return value
    token = getattr(processor, "image_token", None)
    if isinstance(token, str):
        value = processor.tokenizer.convert_tokens_to_ids(token)
        if isinstance(value, int) and value != processor.tokenizer.unk_token_id:
            return value
    raise UnsupportedProcessorLayout(
        f"model type {config.get('model_type')!r}: neither the config nor the processor names an image token"
    )


def token_runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of `token`."""
    runs: list[tuple[int, int]] = []
    start = None
    for position, value in enumerate(ids):
        if value == token and start is None:
            start = position
        elif value != token and start is not None:
            runs.append((start, position))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def _spans_from_replacements(
    ids: Sequence[int],
    token: int,
    offsets: Sequence[Sequence[int]],
    replacements: Sequence[Mapping[str, Any]],
) -> list[tuple[int, int]]:
    """Each image's (start, end) in the ids: its first to last image token inside its replacement text."""
    spans: list[tuple[int, int]] = []
    for n, replacement in enumerate(replacements):
        text_start, text_end = replacement["new_span"]
        inside = [
            position
            for position, value in enumerate(ids)
            if value == token and text_start <= offsets[position][0] and offsets[position][1] <= text_end
        ]
        if not inside:
            raise UnsupportedProcessorLayout(
                f"image {n}'s replacement text holds no image token (id {token})"
            )
        spans.append((inside[0], inside[-1] + 1))
    return spans


def image_spans(
    ids: Sequence[int],
    token: int,
    n_images: int,
    *,
    offsets: Sequence[Sequence[int]] | None = None,
    replacements: Sequence[Mapping[str, Any]] | None = None,
    model_type: str = "",
) -> list[tuple[int, int]]:
    """(start, end) of each image's placeholder span in the processor's input ids, in image order."""
    images = [r for r in replacements or () if r.get("type") == "image"]
    if offsets is not None and len(images) == n_images:
        spans = _spans_from_replacements(ids, token, offsets, images)
    else:
        runs = token_runs(ids, token)
        if len(runs) != n_images:
            raise UnsupportedProcessorLayout(
                f"model type {model_type!r}: the processor's input ids hold {len(runs)} runs of the "
                f"image token (id {token}) for {n_images} images and it reports no per-image replacement "
                "offsets, so which runs belong to which image is unknown"
            )
        spans = runs
    for (_, previous_end), (start, _) in pairwise(spans):
        if start < previous_end:
            raise UnsupportedProcessorLayout(
                f"model type {model_type!r}: image spans overlap at token {start}"
            )
    return spans


def processor_token_view(
    model_dir: Path,
    prompt: str,
    images: Sequence[Image.Image],
    image_facts: Sequence[ImageFacts],
    *,
    block_size: int,
    placeholder_id: int | None = None,
    processor_kwargs: Mapping[str, Any] | None = None,
) -> ProcessorView:
    """Run the model's processor on the rendered prompt and its images; route on what it produced.

    `placeholder_id` overrides the image token the spans are found by; `processor_kwargs` are
    call options the worker would use too (e.g. Gemma 3's `do_pan_and_scan`).
    """
    if len(images) != len(image_facts):
        raise ValueError(f"{len(images)} images but {len(image_facts)} image facts")
    model_dir = Path(model_dir)
    processor = processor_for(model_dir)
    config = _read_json(model_dir / "config.json")
    model_type = str(config.get("model_type", ""))
    token = placeholder_id if placeholder_id is not None else image_token_id(processor, config)

    outputs = processor(
        text=[prompt],
        images=list(images) or None,
        return_tensors="pt",
        return_text_replacement_offsets=True,
        return_offsets_mapping=True,
        **dict(processor_kwargs or {}),
    )
    located = {key: outputs.pop(key) for key in _LOCATING_KEYS if key in outputs}
    ids = [int(i) for i in outputs["input_ids"][0].tolist()]

    in_view: list[ImageInView] = []
    if images:
        offsets = located.get("offset_mapping")
        replacements = located.get("text_replacement_offsets")
        spans = image_spans(
            ids,
            token,
            len(images),
            offsets=offsets[0].tolist() if offsets is not None else None,
            replacements=replacements[0] if replacements else None,
            model_type=model_type,
        )
        in_view = [
            ImageInView(n, facts.identity, facts.routing_hash, facts.width, facts.height, end - start, start)
            for n, (facts, (start, end)) in enumerate(zip(image_facts, spans, strict=True))
        ]
    view = TokenView(
        tokens=ids,
        block_size=block_size,
        images=in_view,
        prompt_tokens=len(ids),
        count_source="transformers processor",
    )
    return ProcessorView(view=view, processed=encode_processed(outputs))


def _encode_tensor(tensor: Any) -> dict[str, Any]:
    import torch

    tensor = tensor.detach().cpu().contiguous()
    described: dict[str, Any] = {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
    }
    if not tensor.is_floating_point() and not tensor.is_complex():
        # Integers and booleans are exact and short in JSON, and readable (image_grid_thw).
        described["values"] = tensor.tolist()
    else:
        # Raw bytes keep every bit (bfloat16 included), and a quarter of the size of decimal text.
        described["b64"] = base64.b64encode(tensor.reshape(-1).view(torch.uint8).numpy().tobytes()).decode(
            "ascii"
        )
    return described


def _json_safe(value: Any) -> Any:
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def encode_processed(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The processor's outputs as JSON: `input_ids` as the one prompt's flat id list; every other
    tensor as {dtype, shape, and `values` (integers, booleans) or `b64` (raw little-endian bytes)};
    lists as lists."""
    processed = {key: _json_safe(value) for key, value in outputs.items() if key != "input_ids"}
    processed["input_ids"] = [int(i) for i in outputs["input_ids"][0].tolist()]
    return processed


def _is_encoded_tensor(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and "dtype" in value
        and "shape" in value
        and ("b64" in value or "values" in value or "media_ref" in value)
    )


def _map_tensors(value: Any, replace: Callable[[Mapping[str, Any]], Any]) -> Any:
    """`value` with each encoded tensor replaced by `replace(tensor)`, through dicts and lists."""
    if _is_encoded_tensor(value):
        return replace(value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, replace) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, replace) for v in value]
    return value


def tensors_by_reference(
    processed: Mapping[str, Any], put_all: Callable[[list[bytes]], Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """`processed` with each tensor's raw bytes (pixel values: megabytes) stored by `put_all`,
    which returns one reference payload per blob (routing.media.store's `media_ref`/`media_bytes`);
    the tensor keeps its dtype and shape, so the message that carries it stays small."""
    blobs: list[bytes] = []
    carried: list[dict[str, Any]] = []  # the tensors that will carry a reference, by blob

    def collect(tensor: Mapping[str, Any]) -> Mapping[str, Any]:
        if "b64" not in tensor:
            return tensor  # `values`: small and exact, it stays in the message
        blobs.append(base64.b64decode(tensor["b64"]))
        carried.append({"dtype": tensor["dtype"], "shape": tensor["shape"]})
        return carried[-1]

    result = {k: _map_tensors(v, collect) for k, v in processed.items() if k != "input_ids"}
    if not blobs:
        return dict(processed)
    for tensor, ref in zip(carried, put_all(blobs), strict=True):
        tensor.update(ref)
    return {**result, "input_ids": processed["input_ids"]}


def _decode_tensor(value: Mapping[str, Any], load: Callable[[Mapping[str, Any]], bytes] | None) -> Any:
    import torch

    dtype = getattr(torch, str(value["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {value['dtype']!r}")
    if "values" in value:
        return torch.tensor(value["values"], dtype=dtype).reshape(value["shape"])
    if "media_ref" in value:
        if load is None:
            raise ValueError("a tensor stored by reference, and no media store to read it from")
        raw = bytearray(load(value))
    else:
        raw = bytearray(base64.b64decode(value["b64"]))
    expected = math.prod(int(n) for n in value["shape"]) * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise ValueError(f"a {value['dtype']} tensor of shape {value['shape']} holds {len(raw)} bytes")
    if not raw:
        return torch.empty(value["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(value["shape"])


def decode_processed(
    processed: Mapping[str, Any], load: Callable[[Mapping[str, Any]], bytes] | None = None
) -> dict[str, Any]:
    """The worker's side of encode_processed: the processor's outputs again, as torch tensors.
    `load` reads a tensor stored by reference (`tensors_by_reference`) from its payload."""
    import torch

    decode = functools.partial(_decode_tensor, load=load)
    decoded = {key: _map_tensors(value, decode) for key, value in processed.items() if key != "input_ids"}
    decoded["input_ids"] = torch.tensor([processed["input_ids"]], dtype=torch.long)
    return decoded
