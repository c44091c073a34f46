"""Block hashes of a prompt, images included: the one function the router's index and the
worker's prefix KV cache both key on (Dynamo's scheme, plus each image's 64-bit hash and offset).
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

BLOCK_HASH_SEED = 1337

_U64_MAX = (1 << 64) - 1
_U64_PAIR = struct.Struct("<QQ")
_MEDIA_TAG = struct.Struct("<Qq")  # routing hash, offset of the media relative to the block
_xxh3_64 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class MediaPlacement:
    """Where one image's placeholder tokens sit in the prompt, and the hash of what it shows."""

    routing_hash: int  # u64, the first 64 bits of the media identity
    start: int  # index of its first placeholder token in the prompt
    length: int  # placeholder tokens


def _token_bytes(tokens: Sequence[int]) -> memoryview:
    """The prompt as little-endian u32s, converted once so each block is a zero-copy slice."""
    if isinstance(tokens, array) and tokens.typecode == "I" and tokens.itemsize == 4:
        packed = tokens
    else:
        try:
            packed = array("I", tokens)
        except OverflowError as exc:
            raise ValueError(f"token ids must be unsigned 32-bit integers: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every platform CPython supports has 4-byte "I"
        raise RuntimeError("array('I') is not 32 bits on this platform")
    if sys.byteorder == "big":  # pragma: no cover - the hash is defined on little-endian bytes
        packed = array("I", packed)
        packed.byteswap()
    return memoryview(packed).cast("B")


def _ordered_media(media: Sequence[MediaPlacement], n_tokens: int) -> list[MediaPlacement]:
    """Media sorted by start, checked to be inside the prompt and not to overlap one another."""
    ordered = sorted(media, key=lambda placement: placement.start)
    previous_end = 0
    for placement in ordered:
        if not 0 <= placement.routing_hash <= _U64_MAX:
            raise ValueError(f"media routing_hash {placement.routing_hash} is not a u64")
        if placement.length < 1 or placement.start < 0 or placement.start + placement.length > n_tokens:
            raise ValueError(
                f"media at {placement.start} (length {placement.length}) lies outside the "
                f"{n_tokens}-token prompt"
            )
        # Overlapping runs would make the moving pointer below skip media; a prompt cannot hold them.
        if placement.start < previous_end:
            raise ValueError(f"media at {placement.start} overlaps the media before it")
        previous_end = placement.start + placement.length
    return ordered


@functools.lru_cache(maxsize=8)
def _block_struct(stride: int) -> struct.Struct:
    return struct.Struct(f"{stride}s")


def local_block_hashes(
    tokens: Sequence[int], block_size: int, media: Sequence[MediaPlacement] = ()
) -> list[int]:
    """Position-independent hash of each full block, with the media each block covers folded in."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    data = _token_bytes(tokens)
    n_blocks = len(tokens) // block_size
    stride = block_size * 4
    # Every block as plain tokens first (one tight comprehension over the blocks' bytes, which
    # iter_unpack cuts in C: a third faster than slicing a memoryview per block), then the
    # blocks a media run covers hashed again with its tags. Hashing a covered block twice costs
    # less than a per-block test for media, and images cover a fraction of a prompt.
    cut = _block_struct(stride).iter_unpack(data[: n_blocks * stride])
    if not media:
        return [_xxh3_64(block, BLOCK_HASH_SEED) for (block,) in cut]
    blocks = [block for (block,) in cut]
    hashes = [_xxh3_64(block, BLOCK_HASH_SEED) for block in blocks]

    # A run's first and last covered blocks may hold another run's tokens too (tags in start
    # order); the blocks between them hold this run's alone, and go in one comprehension.
    pack = _MEDIA_TAG.pack
    edges: dict[int, list[bytes]] = {}
    for placement in _ordered_media(media, len(tokens)):
        start, routing_hash = placement.start, placement.routing_hash
        first = start // block_size
        stop = min(-(-(start + placement.length) // block_size), n_blocks)
        if first >= stop:  # inside the partial last block, which is not hashed
            continue
        for block in (first, stop - 1) if stop - 1 > first else (first,):
            edges.setdefault(block, []).append(pack(routing_hash, start - block * block_size))
        hashes[first + 1 : stop - 1] = [
            _xxh3_64(blocks[block] + pack(routing_hash, start - block * block_size), BLOCK_HASH_SEED)
            for block in range(first + 1, stop - 1)
        ]
    for block, tags in edges.items():
        hashes[block] = _xxh3_64(b"".join([blocks[block], *tags]), BLOCK_HASH_SEED)
    return hashes


def local_block_hash(block_tokens: Sequence[int], media_tags: Sequence[tuple[int, int]] = ()) -> int:
    """One full block's local hash, as `local_block_hashes` computes it for a block of a prompt:
    the block's tokens, then a (routing hash, media start - block start) tag for each media run
    it covers, in start order. For an engine that reports its blocks one by one (vLLM's KV
    events carry each block's tokens and the (media, offset) pairs it covers)."""
    data = _token_bytes(block_tokens).tobytes()
    return _xxh3_64(
        b"".join([data, *(_MEDIA_TAG.pack(h, offset) for h, offset in media_tags)]), BLOCK_HASH_SEED
    )


def next_sequence_hash(previous: int | None, local: int, salt: int | None = None) -> int:
    """The sequence hash of a block whose predecessor's sequence hash is `previous` (None: the
    prompt's first block, salted as `chain_sequence_hashes` salts it)."""
    if previous is None:
        return chain_sequence_hashes([local], salt)[0]
    return _xxh3_64(_U64_PAIR.pack(previous, local), BLOCK_HASH_SEED)


def cache_salt(*parts: str) -> int:
    """The u64 a cache partition folds into the first block (a tenant, a request's `cache_salt`).

    Length-prefixed parts, so ("ab", "c") and ("a", "bc") give two salts.
    """
    message = b"".join(len(part.encode()).to_bytes(4, "little") + part.encode() for part in parts)
    return _xxh3_64(message, BLOCK_HASH_SEED)


def partition_salt(model_fingerprint: str, salt: int | None) -> int | None:
    """The salt a prompt's first block folds in: the model's partition composed with the caller's.

    The model's fingerprint (routing.prompt.model_card) partitions the index by model, so the same
    text or image sent to two models never counts as overlap; a tenant's salt partitions within
    it. Without a fingerprint (a bare engine, a unit test) the caller's salt alone, as before.
    """
    if not model_fingerprint:
        return salt
    return cache_salt("model", model_fingerprint, "" if salt is None else f"{salt & _U64_MAX:016x}")


def chain_sequence_hashes(local: Sequence[int], salt: int | None = None) -> list[int]:
    """Chain local hashes so each one also stands for every block before it.

    A salt (a cache partition's, see `cache_salt`) folds into the first block's sequence hash
    and so into every later one: two partitions never share a block, while the local hashes
    (what a block holds) stay the same.
    """
    if not local:
        return []
    previous = (
        local[0] if salt is None else _xxh3_64(_U64_PAIR.pack(salt & _U64_MAX, local[0]), BLOCK_HASH_SEED)
    )
    sequence = [previous]
    append = sequence.append
    pack = _U64_PAIR.pack
    for current in local[1:]:
        previous = _xxh3_64(pack(previous, current), BLOCK_HASH_SEED)
        append(previous)
    return sequence


def block_hashes(
    tokens: Sequence[int], block_size: int, media: Sequence[MediaPlacement] = (), *, salt: int | None = None
) -> list[int]:
    """Sequence hashes of the prompt's full blocks: what the index and the KV cache key on."""
    return chain_sequence_hashes(local_block_hashes(tokens, block_size, media), salt)
