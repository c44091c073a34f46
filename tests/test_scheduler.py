"""The engine's scheduler without a model: what each step computes, within the token budget and
the running cap, how a dry pool preempts the youngest request, and how cached prefixes are reused."""

from __future__ import annotations

import pytest

from routing.prompt.hashing import block_hashes, local_block_hashes
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


# --- which prompt goes first ----------------------------------------------------------------------
def shortest_first(budget: int, join_tokens: int = 4, capacity: int = 64) -> Scheduler:
    pool = KvPool(capacity_blocks=capacity, block_size=BLOCK, worker="w")
    return Scheduler(pool, max_batch_tokens=budget, max_running=8, join_tokens=join_tokens)


def test_a_short_prompt_goes_before_a_longer_one_that_came_first_and_does_not_wait_for_it() -> None:
    scheduler = shortest_first(budget=64)
    scheduler.add(sequence("long", list(range(100, 140))))  # 40 tokens
    scheduler.add(sequence("short", [1, 2, 3]))

    # the short one alone: sharing the step, its first token would wait for all 40 of the other's
    assert step(scheduler) == {"short": 3}
    assert step(scheduler) == {"short": 1, "long": 40}


def test_fcfs_keeps_arrival_order_and_packs_the_step() -> None:
    pool = KvPool(capacity_blocks=64, block_size=BLOCK, worker="w")
    scheduler = Scheduler(pool, max_batch_tokens=64, max_running=8, policy="fcfs")
    scheduler.add(sequence("long", list(range(100, 140))))
    scheduler.add(sequence("short", [1, 2, 3]))

    assert step(scheduler) == {"long": 40, "short": 3}


def test_a_prompt_is_as_short_as_what_the_cache_does_not_hold_of_it() -> None:
    # given: a 40-token prompt whose first 36 tokens are cached, and a cold 12-token prompt before it
    scheduler = shortest_first(budget=64)
    cached = list(range(200, 240))
    scheduler.add(sequence("first", cached))
    step(scheduler)
    scheduler.finish(scheduler.running[0])
    scheduler.add(sequence("cold", list(range(300, 312))))
    scheduler.add(sequence("hit", [*cached[:36], 1, 2, 3, 4]))

    # then: the hit (4 tokens left) goes first, the cold one next
    assert step(scheduler) == {"hit": 4}
    assert step(scheduler) == {"hit": 1, "cold": 12}


def test_a_prompt_in_chunks_lets_a_short_arrival_through_between_two_chunks() -> None:
    scheduler = shortest_first(budget=8)
    scheduler.add(sequence("long", list(range(100, 130))))  # 30 tokens: four chunks
    assert step(scheduler) == {"long": 8}

    scheduler.add(sequence("short", [1, 2, 3]))
    assert step(scheduler) == {"short": 3}
    assert step(scheduler) == {"short": 1, "long": 7}


def test_a_prompt_passed_over_moves_up_until_it_runs_however_many_shorter_ones_come() -> None:
    scheduler = shortest_first(budget=16, join_tokens=0, capacity=256)
    scheduler.add(sequence("long", list(range(100, 112))))  # 12 tokens
    ran_at = None
    for n in range(10):
        scheduler.add(sequence(f"short{n}", [n + 1, n + 2]))  # a new 2-token prompt every step
        if "long" in step(scheduler):
            ran_at = n
            break

    assert ran_at == 1  # passed over once (12 - 16 < 2): then it goes first


def test_an_unknown_policy_is_refused() -> None:
    pool = KvPool(capacity_blocks=8, block_size=BLOCK, worker="w")
    with pytest.raises(ValueError, match="shortest_first, fcfs"):
        Scheduler(pool, max_batch_tokens=8, max_running=2, policy="lifo")


def test_fcfs_starts_a_long_prompt_in_what_is_left_of_a_step() -> None:
    pool = KvPool(capacity_blocks=64, block_size=BLOCK, worker="w")
    scheduler = Scheduler(pool, max_batch_tokens=16, max_running=8, policy="fcfs")
    scheduler.add(sequence("short", [1, 2, 3]))
    scheduler.add(sequence("long", list(range(100, 140))))  # longer than a step: it is split anyway

    assert step(scheduler) == {"short": 3, "long": 13}


@pytest.mark.parametrize("policy", ["shortest_first", "fcfs"])
def test_a_prompt_waits_for_the_blocks_another_is_computing_rather_than_computing_them_too(policy) -> None:
    # given two prompts that share their first 16 tokens (four blocks), the first longer than a
    # step, the second arriving with it (a burst about one new picture, sent to one worker)
    pool = KvPool(capacity_blocks=64, block_size=BLOCK, worker="w")
    scheduler = Scheduler(pool, max_batch_tokens=8, max_running=4, policy=policy)
    shared = list(range(100, 116))
    first = sequence("first", [*shared, 1, 2, 3, 4])
    second = sequence("second", [*shared, 5, 6, 7, 8])
    scheduler.add(first)
    scheduler.add(second)

    # when the first computes the shared blocks, chunk by chunk
    steps = [step(scheduler) for _ in range(3)]

    # then the second never computes them again: it waits (although, passed over, it would go
    # first under shortest_first) and reuses all four once they are cached
    assert steps[:2] == [{"first": 8}, {"first": 8}]
    assert set(steps[2]) == {"first", "second"} and steps[2]["second"] == 4
    assert second.cached_tokens == 16


def test_a_prompt_computes_a_shared_prefix_itself_when_its_sibling_is_gone() -> None:
    pool = KvPool(capacity_blocks=64, block_size=BLOCK, worker="w")
    scheduler = Scheduler(pool, max_batch_tokens=8, max_running=4)
    shared = list(range(100, 116))
    first = sequence("first", [*shared, 1, 2, 3, 4])
    scheduler.add(first)
    scheduler.add(sequence("second", [*shared, 5, 6, 7, 8]))
    assert step(scheduler) == {"first": 8}

    first.cancelled = True  # the client left mid-prefill
    scheduler.drop_cancelled()
    assert step(scheduler) == {"second": 8}  # the two cached blocks reused, the rest its own


@pytest.mark.parametrize("policy", ["shortest_first", "fcfs"])
def test_waiting_prompts_of_a_higher_priority_start_first_whatever_came_before(policy) -> None:
    # given room for two of four waiting prompts: two of a batch job's first, then two urgent
    scheduler = Scheduler(
        KvPool(capacity_blocks=64, block_size=BLOCK, worker="w"),
        max_batch_tokens=100,
        max_running=2,
        policy=policy,
    )
    for n in range(2):
        scheduler.add(sequence(f"batch{n}", [n] * 5))
    for n in range(2):
        urgent = sequence(f"urgent{n}", [10 + n] * 5)
        urgent.priority = 9
        scheduler.add(urgent)

    # then the urgent ones run, the batch job's wait
    assert set(step(scheduler)) == {"urgent0", "urgent1"}
    assert [s.request_id for s in scheduler.waiting] == ["batch0", "batch1"]
