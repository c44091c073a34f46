"""The engine's scheduler without a model: what each step computes, within the token budget and
the running cap, how a dry pool preempts the youngest request, and how cached prefixes are reused."""

from __future__ import annotations

from routing.hashing import block_hashes, local_block_hashes
from workers.kv_cache import KvPool
from workers.scheduler import Scheduler, SequenceState

BLOCK = 4


def sequence(name: str, prompt: list[int], max_tokens: int = 8) -> SequenceState:
    return SequenceState(
        request_id=name,
        tokens=list(prompt),
        prompt_len=len(prompt),
        max_tokens=max_tokens,
        sequence_hashes=block_hashes(prompt, BLOCK),
        local_hashes=local_block_hashes(prompt, BLOCK),
    )


def step(scheduler: Scheduler) -> dict[str, int]:
    """One step: what it schedules ({request: tokens}); sampled requests get a token 0."""
    plan = scheduler.schedule()
    for chunk in plan.chunks:
        scheduler.computed(chunk)
        if chunk.samples:
            chunk.sequence.tokens.append(0)
    return {chunk.sequence.request_id: chunk.count for chunk in plan.chunks}


def test_decodes_go_first_and_a_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    scheduler = Scheduler(
        KvPool(capacity_blocks=64, block_size=BLOCK, worker="w"), max_batch_tokens=10, max_running=4
    )
    scheduler.add(sequence("short", [1, 2, 3]))
    assert step(scheduler) == {"short": 3}

    scheduler.add(sequence("long", list(range(100, 125))))  # 25 tokens
    steps = [step(scheduler) for _ in range(4)]

    assert steps == [
        {"short": 1, "long": 9},
        {"short": 1, "long": 9},
        {"short": 1, "long": 7},
        {"short": 1, "long": 1},
    ]
    assert all(sum(s.values()) <= 10 for s in steps)


def test_the_running_cap_keeps_the_rest_waiting() -> None:
    scheduler = Scheduler(
        KvPool(capacity_blocks=64, block_size=BLOCK, worker="w"), max_batch_tokens=100, max_running=2
    )
    for n in range(3):
        scheduler.add(sequence(f"r{n}", [n] * 5))

    assert step(scheduler) == {"r0": 5, "r1": 5}
    assert [s.request_id for s in scheduler.waiting] == ["r2"]


def test_a_prompt_that_fits_a_step_of_its_own_waits_rather_than_being_split() -> None:
    scheduler = Scheduler(
        KvPool(capacity_blocks=64, block_size=BLOCK, worker="w"), max_batch_tokens=12, max_running=4
    )
    scheduler.add(sequence("a", [1] * 8))
    scheduler.add(sequence("b", [2] * 8))

    assert step(scheduler) == {"a": 8}  # b would get 4 of its 8 tokens: it waits
    assert step(scheduler) == {"a": 1, "b": 8}


def test_a_dry_pool_preempts_the_youngest_which_then_starts_over() -> None:
    # given a pool of 6 blocks and two requests that will need 4 blocks each
    pool = KvPool(capacity_blocks=6, block_size=BLOCK, worker="w")
    scheduler = Scheduler(pool, max_batch_tokens=64, max_running=4)
    old, young = sequence("old", [1] * 8, 8), sequence("young", [2] * 8, 8)
    scheduler.add(old)
    scheduler.add(young)
    assert step(scheduler) == {"old": 8, "young": 8}  # 2 + 2 blocks

    # when both decode until the oldest needs a fourth block
    for _ in range(5):
        step(scheduler)

    # then the youngest went back to waiting with nothing held, and the oldest kept running
    assert young.preemptions == 1 and young in scheduler.waiting
    assert young.block_ids == [] and young.computed == 0
    assert scheduler.running == [old] and len(old.block_ids) == 4
    scheduler.finish(old)
    pending = len(young.tokens) - (young.prompt_len - 1)
    # its prompt's blocks stayed cached: only its last prompt token and its output are recomputed
    assert step(scheduler) == {"young": pending}


def test_a_wholly_cached_prompt_reuses_every_block_and_recomputes_only_its_last_token() -> None:
    pool = KvPool(capacity_blocks=16, block_size=BLOCK, worker="w")
    scheduler = Scheduler(pool, max_batch_tokens=64, max_running=4)
    first = sequence("first", list(range(8)))
    scheduler.add(first)
    step(scheduler)
    scheduler.finish(first)

    again = sequence("again", list(range(8)))
    scheduler.add(again)
    assert step(scheduler) == {"again": 1}

    assert again.cached_tokens == 7
    assert again.copy_from is not None  # the cached last block, copied into its own before the step
    assert again.copy_from not in again.block_ids
    assert pool.block_hashes() == set(again.sequence_hashes)
