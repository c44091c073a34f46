"""Block hashes: Dynamo's text vector, chaining, and what an image's identity and place change."""

from __future__ import annotations

import random
import struct
import time

import pytest
import xxhash

from routing.prompt.hashing import (
    BLOCK_HASH_SEED,
    MediaPlacement,
    block_hashes,
    chain_sequence_hashes,
    local_block_hash,
    local_block_hashes,
    next_sequence_hash,
)

IMAGE_A = 0x0123_4567_89AB_CDEF
IMAGE_B = 0xFEDC_BA98_7654_3210


def _prompt(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def test_text_block_matches_dynamo_test_vector() -> None:
    assert local_block_hashes([1, 2, 3, 4], 4) == [14643705804678351452]
    assert block_hashes([1, 2, 3, 4], 4) == [14643705804678351452]


def test_local_hash_is_xxh3_of_little_endian_u32_tokens() -> None:
    tokens = [5, 70_000, 2**32 - 1, 0]
    expected = xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens), seed=BLOCK_HASH_SEED)
    assert local_block_hashes(tokens, 4) == [expected]


def test_sequence_hashes_chain_each_block_to_the_one_before() -> None:
    local = local_block_hashes(_prompt(48), 16)
    sequence = chain_sequence_hashes(local)
    assert sequence[0] == local[0]
    for i in (1, 2):
        packed = struct.pack("<QQ", sequence[i - 1], local[i])
        assert sequence[i] == xxhash.xxh3_64_intdigest(packed, seed=BLOCK_HASH_SEED)
    assert block_hashes(_prompt(48), 16) == sequence


def test_repeated_block_gets_different_sequence_hashes_at_different_positions() -> None:
    block = _prompt(16)
    local = local_block_hashes(block * 3, 16)
    assert len(set(local)) == 1
    assert len(set(block_hashes(block * 3, 16))) == 3


def test_partial_last_block_is_not_hashed() -> None:
    assert len(block_hashes(_prompt(63), 16)) == 3
    assert block_hashes(_prompt(63), 16) == block_hashes(_prompt(64), 16)[:3]
    assert block_hashes(_prompt(15), 16) == []
    assert chain_sequence_hashes([]) == []


def test_a_prefix_shares_the_leading_hashes() -> None:
    prompt = _prompt(160)
    longer = prompt + _prompt(80, seed=99)
    assert block_hashes(longer, 16)[:10] == block_hashes(prompt, 16)


def test_one_token_change_changes_its_block_and_every_later_one_but_none_before() -> None:
    prompt = _prompt(160)
    changed = list(prompt)
    changed[77] += 1  # block 4
    before, after = block_hashes(prompt, 16), block_hashes(changed, 16)
    assert after[:4] == before[:4]
    assert all(x != y for x, y in zip(before[4:], after[4:], strict=True))


def test_a_different_image_changes_the_blocks_it_covers_and_none_before() -> None:
    prompt = _prompt(160)
    # placeholders 40..99 cover blocks 2 to 6
    with_a = block_hashes(prompt, 16, [MediaPlacement(IMAGE_A, 40, 60)])
    with_b = block_hashes(prompt, 16, [MediaPlacement(IMAGE_B, 40, 60)])
    assert _first_difference(with_a, with_b) == 2
    assert all(x != y for x, y in zip(with_a[2:], with_b[2:], strict=True))

    local_a = local_block_hashes(prompt, 16, [MediaPlacement(IMAGE_A, 40, 60)])
    local_b = local_block_hashes(prompt, 16, [MediaPlacement(IMAGE_B, 40, 60)])
    changed = [i for i, (x, y) in enumerate(zip(local_a, local_b, strict=True)) if x != y]
    assert changed == [2, 3, 4, 5, 6]


def test_image_changes_hashes_even_when_placeholder_tokens_are_identical() -> None:
    placeholder = 151_655
    prompt = [1] * 8 + [placeholder] * 64 + [2] * 8
    assert block_hashes(prompt, 16, [MediaPlacement(IMAGE_A, 8, 64)]) != block_hashes(
        prompt, 16, [MediaPlacement(IMAGE_B, 8, 64)]
    )
    assert block_hashes(prompt, 16, [MediaPlacement(IMAGE_A, 8, 64)]) != block_hashes(prompt, 16)


def test_the_same_image_at_another_offset_changes_the_blocks_from_where_it_starts() -> None:
    prompt = _prompt(160)
    at_40 = block_hashes(prompt, 16, [MediaPlacement(IMAGE_A, 40, 60)])
    at_41 = block_hashes(prompt, 16, [MediaPlacement(IMAGE_A, 41, 60)])
    assert _first_difference(at_40, at_41) == 2


def test_covered_block_hash_appends_routing_hash_and_offset_relative_to_the_block() -> None:
    # image at 2..9 spans block 0 (offset 2) and block 1 (offset -6: it began in block 0)
    local = local_block_hashes(list(range(16)), 8, [MediaPlacement(IMAGE_A, 2, 8)])
    block0 = struct.pack("<8I", *range(8)) + struct.pack("<Qq", IMAGE_A, 2)
    block1 = struct.pack("<8I", *range(8, 16)) + struct.pack("<Qq", IMAGE_A, -6)
    assert local == [
        xxhash.xxh3_64_intdigest(block0, seed=BLOCK_HASH_SEED),
        xxhash.xxh3_64_intdigest(block1, seed=BLOCK_HASH_SEED),
    ]


def test_several_images_in_one_block_are_folded_in_order_of_start_whatever_the_input_order() -> None:
    tokens = list(range(16))
    media = [MediaPlacement(IMAGE_B, 10, 3), MediaPlacement(IMAGE_A, 2, 4)]
    expected = xxhash.xxh3_64_intdigest(
        struct.pack("<16I", *tokens) + struct.pack("<Qq", IMAGE_A, 2) + struct.pack("<Qq", IMAGE_B, 10),
        seed=BLOCK_HASH_SEED,
    )
    assert local_block_hashes(tokens, 16, media) == [expected]
    assert local_block_hashes(tokens, 16, list(reversed(media))) == [expected]


def _reference_local_hashes(tokens: list[int], block_size: int, media: list[MediaPlacement]) -> list[int]:
    """The definition, block by block: its tokens, then the tag of every run it touches by start."""
    hashes = []
    for block in range(len(tokens) // block_size):
        lo, hi = block * block_size, (block + 1) * block_size
        data = struct.pack(f"<{block_size}I", *tokens[lo:hi])
        for m in sorted(media, key=lambda m: m.start):
            if m.start < hi and m.start + m.length > lo:
                data += struct.pack("<Qq", m.routing_hash, m.start - lo)
        hashes.append(xxhash.xxh3_64_intdigest(data, seed=BLOCK_HASH_SEED))
    return hashes


def test_runs_of_every_length_and_place_hash_as_the_block_by_block_definition() -> None:
    # given: seeded prompts with runs inside one block, across several, sharing a block with the
    # next, ending in the unhashed tail, in any order (the hashing takes each run's edge blocks
    # and the blocks between them apart)
    rng = random.Random(11)
    for _ in range(400):
        block_size = rng.choice((1, 2, 3, 16))
        tokens = _prompt(rng.randrange(0, 120), seed=rng.randrange(1000))
        media, at = [], 0
        while rng.random() < 0.8:
            start, length = at + rng.randrange(0, 12), rng.randrange(1, 40)
            if start + length > len(tokens):
                break
            media.append(MediaPlacement(rng.getrandbits(64), start, length))
            at = start + length
        rng.shuffle(media)
        expected = _reference_local_hashes(tokens, block_size, media)
        # then
        assert local_block_hashes(tokens, block_size, media) == expected


def test_swapping_two_images_changes_the_hashes() -> None:
    prompt = _prompt(128)
    ab = [MediaPlacement(IMAGE_A, 16, 32), MediaPlacement(IMAGE_B, 64, 32)]
    ba = [MediaPlacement(IMAGE_B, 16, 32), MediaPlacement(IMAGE_A, 64, 32)]
    assert _first_difference(block_hashes(prompt, 16, ab), block_hashes(prompt, 16, ba)) == 1


@pytest.mark.parametrize(
    ("tokens", "block_size", "media"),
    [
        ([1, 2, 3, 4], 0, ()),
        ([1, -2, 3, 4], 4, ()),
        ([1, 2**32, 3, 4], 4, ()),
        ([1, 2, 3, 4], 4, [MediaPlacement(IMAGE_A, 2, 3)]),  # runs past the prompt
        ([1, 2, 3, 4], 4, [MediaPlacement(2**64, 0, 2)]),
        ([0] * 16, 4, [MediaPlacement(IMAGE_A, 0, 8), MediaPlacement(IMAGE_B, 4, 4)]),  # overlap
        ([0] * 16, 4, [MediaPlacement(IMAGE_A, 0, 0)]),
    ],
)
def test_invalid_input_is_refused(tokens: list[int], block_size: int, media: list[MediaPlacement]) -> None:
    with pytest.raises(ValueError):
        block_hashes(tokens, block_size, media)


def test_a_240k_token_prompt_hashes_in_milliseconds() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(2**32) for _ in range(240_000)]
    media = [MediaPlacement(rng.getrandbits(64), start, 1200) for start in range(500, 238_000, 2_000)]
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        hashes = block_hashes(tokens, 16, media)
        timings.append(time.perf_counter() - started)
    assert len(hashes) == 15_000
    # Typically ~10 ms here; the bound only catches a quadratic media scan or per-token packing.
    assert min(timings) < 0.15


def test_a_prompt_hashed_block_by_block_from_its_media_tags_equals_the_whole_prompts_hashes() -> None:
    # given a prompt of 6 blocks of 8 with two images, one spanning three blocks
    size = 8
    tokens = [7, 8, 9, *[5] * 19, 1, 2, *[5] * 6, *range(100, 118)]
    media = [MediaPlacement(0xA1A1A1A1A1A1A1A1, 3, 19), MediaPlacement(0xB2B2B2B2B2B2B2B2, 24, 6)]
    whole_local = local_block_hashes(tokens, size, media)
    whole = block_hashes(tokens, size, media, salt=99)

    # when each block is hashed alone from its tokens and (media, start - block start) tags, as
    # an engine's KV events report them, and chained from the previous block's sequence hash
    local, chained, previous = [], [], None
    for block in range(len(tokens) // size):
        start = block * size
        tags = [
            (m.routing_hash, m.start - start)
            for m in media
            if m.start < start + size and m.start + m.length > start
        ]
        local.append(local_block_hash(tokens[start : start + size], tags))
        previous = next_sequence_hash(previous, local[-1], salt=99)
        chained.append(previous)

    # then both ways agree on every block
    assert local == whole_local
    assert chained == whole
