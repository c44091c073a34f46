"""Image features on their way from an encode worker to an LLM worker (E/PD), as bytes: the blobs
the encode worker puts in the media side store (routing.media.store) for the LLM worker to read.

One blob per image: a little-endian u32 header length, a JSON header (format version, dtype,
shape, what the features are of, and an xxh3-128 checksum of the data), then the tensor's raw
bytes. Raw bytes, never pickle: a blob is read by another process and must not run code. The
reader checks everything before it trusts a row: a blob that does not decode, was made for
another image, model or processor, or whose data does not match its checksum is refused
(`CorruptEmbedding`), and the LLM worker encodes the image itself.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
_HEADER_LENGTH = struct.Struct("<I")
_MAX_HEADER_BYTES = 64 * 1024


class CorruptEmbedding(ValueError):
    """A blob that is not the features it claims to be."""


@dataclass(frozen=True)
class EmbeddingLabel:
    """What a blob must be of: the same fields as the embedding cache key, less the scope."""

    identity: str
    model: str
    processor_fingerprint: str


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def pack_embedding(embedding: torch.Tensor, label: EmbeddingLabel) -> bytes:
    import torch

    tensor = embedding.detach().to("cpu").contiguous()
    data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    header = json.dumps(
        {
            "v": FORMAT_VERSION,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "identity": label.identity,
            "model": label.model,
            "processor_fingerprint": label.processor_fingerprint,
            "checksum": checksum(data),
        },
        sort_keys=True,
    ).encode()
    return _HEADER_LENGTH.pack(len(header)) + header + data


def unpack_embedding(blob: bytes, label: EmbeddingLabel) -> torch.Tensor:
    """The tensor in `blob`, once its header matches `label` and its data its checksum."""
    import torch

    if len(blob) < _HEADER_LENGTH.size:
        raise CorruptEmbedding(f"a {len(blob)}-byte blob has no header")
    (header_length,) = _HEADER_LENGTH.unpack_from(blob)
    if header_length > _MAX_HEADER_BYTES or _HEADER_LENGTH.size + header_length > len(blob):
        raise CorruptEmbedding(f"header length {header_length} does not fit a {len(blob)}-byte blob")
    try:
        header = json.loads(blob[_HEADER_LENGTH.size : _HEADER_LENGTH.size + header_length])
        version, dtype_name, shape = header["v"], header["dtype"], [int(n) for n in header["shape"]]
        expected = (header["identity"], header["model"], header["processor_fingerprint"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEmbedding(f"the header does not decode: {exc}") from exc
    if version != FORMAT_VERSION:
        raise CorruptEmbedding(f"format version {version!r}, this worker reads {FORMAT_VERSION}")
    if expected != (label.identity, label.model, label.processor_fingerprint):
        raise CorruptEmbedding(
            f"features of image {expected[0]} for model {expected[1]} (processor {expected[2]}), "
            f"expected image {label.identity} for {label.model} (processor {label.processor_fingerprint})"
        )
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CorruptEmbedding(f"dtype {dtype_name!r} is not a floating point type")
    data = memoryview(blob)[_HEADER_LENGTH.size + header_length :]
    element = torch.empty((), dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    if len(shape) != 2 or min(shape) < 0 or count * element != len(data):
        raise CorruptEmbedding(f"shape {shape} of {dtype_name} does not match {len(data)} bytes of data")
    if checksum(data) != header["checksum"]:
        raise CorruptEmbedding("the data does not match its checksum")
    if not count:
        return torch.empty(shape, dtype=dtype)
    # A copy: the tensor must own writable memory, not alias the Redis reply.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
