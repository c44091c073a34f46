"""Features travel between workers as checked bytes: exact on the way, refused when anything
about them is off (so the LLM worker encodes locally instead)."""

from __future__ import annotations

import pytest
import torch

from workers.embedding_transfer import CorruptEmbedding, EmbeddingLabel, pack_embedding, unpack_embedding

LABEL = EmbeddingLabel(identity="a" * 32, model="demo", processor_fingerprint="f00d")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_features_arrive_bit_for_bit(dtype: torch.dtype) -> None:
    features = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)

    received = unpack_embedding(pack_embedding(features, LABEL), LABEL)

    assert received.dtype == dtype and received.shape == features.shape
    assert torch.equal(received, features)
    received[0, 0] = 1.0  # the tensor owns its memory (it does not alias the blob)


def test_a_flipped_byte_in_the_data_is_caught_by_the_checksum() -> None:
    blob = bytearray(pack_embedding(torch.ones(4, 8), LABEL))
    blob[-3] ^= 0x01

    with pytest.raises(CorruptEmbedding, match="checksum"):
        unpack_embedding(bytes(blob), LABEL)


@pytest.mark.parametrize(
    "label",
    [
        EmbeddingLabel("b" * 32, "demo", "f00d"),  # another image
        EmbeddingLabel("a" * 32, "other-model", "f00d"),
        EmbeddingLabel("a" * 32, "demo", "beef"),  # other processor settings
    ],
)
def test_features_of_something_else_are_refused(label: EmbeddingLabel) -> None:
    with pytest.raises(CorruptEmbedding, match="expected image"):
        unpack_embedding(pack_embedding(torch.ones(4, 8), LABEL), label)


@pytest.mark.parametrize("cut", [0, 2, 20, -1])
def test_truncated_or_garbled_blobs_are_refused_not_crashing(cut: int) -> None:
    blob = pack_embedding(torch.ones(4, 8), LABEL)

    with pytest.raises(CorruptEmbedding):
        unpack_embedding(blob[:cut], LABEL)
    with pytest.raises(CorruptEmbedding):
        unpack_embedding(b"\xff\xff\xff\x7f" + blob[4:], LABEL)
