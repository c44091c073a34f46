"""vLLM's KV events in the router's terms (workers.vllm_engine.kv_events): pure, no vLLM needed.

The events are shaped as vLLM 0.32 publishes them (seen on the demo Qwen2-VL checkpoint): per
block, extra_keys of ([uuid, image start - block start], ...) and, on a prompt's first block,
the cache salt as 16 hex digits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from routing.media.images import routing_hash
from routing.prompt.hashing import MediaPlacement, block_hashes
from workers.vllm_engine.kv_events import KvEventTranslator

BLOCK = 32
IMAGE = 12
UUID = "ab" * 16  # the pixels' identity vLLM keys on
IDENTITY = "0123456789abcdef" * 2  # the task's (URL) identity the router hashed


@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int = BLOCK
    extra_keys: list[Any] | None = None
    medium: str = "GPU"


@dataclass
class BlockRemoved:
    block_hashes: list[Any]
    medium: str = "GPU"


@dataclass
class AllBlocksCleared:
    medium: str = "GPU"
    extra: list[Any] = field(default_factory=list)


def prompt() -> tuple[list[int], int, int]:
    """Three blocks: text, a 48-placeholder image from token 5, text."""
    tokens = [1, 2, 3, 4, 10, *[IMAGE] * 48, 11, *range(200, 243)]
    return tokens[: 3 * BLOCK], 5, 48


def stored_event(tokens: list[int], start: int, salt: str | None) -> BlockStored:
    """What vLLM published for the prompt: its own hashes, the image tags per block."""
    extra = []
    for block in range(len(tokens) // BLOCK):
        keys: list[Any] = []
        if start < (block + 1) * BLOCK and start + 48 > block * BLOCK:
            keys.append([UUID, start - block * BLOCK])
        if block == 0 and salt is not None:
            keys.append(salt)
        extra.append(tuple(keys) or None)
    return BlockStored(
        block_hashes=[101, 102, 103][: len(tokens) // BLOCK],
        parent_block_hash=None,
        token_ids=tokens,
        extra_keys=extra,
    )


def translator() -> KvEventTranslator:
    t = KvEventTranslator("v1", BLOCK)
    t.remember_media([UUID], [routing_hash(IDENTITY)])
    return t


def test_stored_blocks_are_announced_with_the_routers_own_hashes() -> None:
    # given the router's hashes of a salted prompt with an image (its URL identity folded in)
    tokens, start, length = prompt()
    router = block_hashes(tokens, BLOCK, [MediaPlacement(routing_hash(IDENTITY), start, length)], salt=0xFF)

    # when vLLM reports storing the prompt's blocks, keyed on the pixels' uuid
    (event,) = translator().translate([stored_event(tokens, start, "00000000000000ff")])

    # then the index is told the router's hashes, in order, from no parent
    assert event.kind == "stored" and event.worker == "v1"
    assert list(event.block_hashes) == router
    assert event.parent_hash is None


def test_a_republished_block_is_announced_once_and_removed_once() -> None:
    tokens, start, _ = prompt()
    t = translator()
    (first,) = t.translate([stored_event(tokens, start, None)])

    # when vLLM publishes the same blocks again, then evicts one
    again = t.translate([stored_event(tokens, start, None)])
    (removed,) = t.translate([BlockRemoved([103]), BlockRemoved([103])])

    # then nothing new was announced, and the eviction names the router's block once
    assert again == []
    assert removed.kind == "removed" and removed.block_hashes == (first.block_hashes[2],)
    assert t.held() == set(first.block_hashes[:2])


def test_a_child_block_chains_from_its_parents_router_hash() -> None:
    tokens, start, length = prompt()
    t = translator()
    t.translate([stored_event(tokens[: 2 * BLOCK], start, None)])
    child = BlockStored(
        block_hashes=[103], parent_block_hash=102, token_ids=tokens[2 * BLOCK :], extra_keys=[None]
    )

    (event,) = t.translate([child])

    router = block_hashes(tokens, BLOCK, [MediaPlacement(routing_hash(IDENTITY), start, length)])
    assert event.block_hashes == (router[2],) and event.parent_hash == router[1]


def test_two_pictures_under_one_url_are_one_router_block_until_both_are_evicted() -> None:
    # given the same URL identity served two pictures (two uuids vLLM keys apart)
    tokens, start, _ = prompt()
    t = translator()
    other = "cd" * 16
    t.remember_media([other], [routing_hash(IDENTITY)])
    (first,) = t.translate([stored_event(tokens, start, None)])
    second = stored_event(tokens, start, None)
    second.block_hashes = [201, 202, 203]
    second.extra_keys = [((other, start),), ((other, start - BLOCK),), None]

    # when vLLM stores the second picture's blocks, then evicts the first picture's
    announced = t.translate([second])
    after_first_evicted = t.translate([BlockRemoved([101, 102, 103])])

    # then the router was told nothing new, and keeps the blocks the second picture still holds
    assert announced == []
    assert after_first_evicted == []
    assert t.held() == set(first.block_hashes)


def test_a_block_whose_image_uuid_is_unknown_is_not_announced() -> None:
    # given a translator never told which routing hash the image's uuid stands for
    tokens, start, _ = prompt()
    t = KvEventTranslator("v1", BLOCK)

    # when vLLM stores the prompt, whose first block already holds the image
    announced = t.translate([stored_event(tokens, start, None)])

    # then nothing is guessed at: the blocks are counted as untranslated, not announced
    assert announced == []
    assert t.untranslated == 3 and t.held() == set()


def test_all_blocks_cleared_empties_the_mirror_and_says_cleared() -> None:
    tokens, start, _ = prompt()
    t = translator()
    t.translate([stored_event(tokens, start, None)])

    (event,) = t.translate([AllBlocksCleared()])

    assert event.kind == "cleared" and t.held() == set()
