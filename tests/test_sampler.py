"""Per-request sampling: tiny temperatures and top_p are greedy, bad values name their field, and
a seeded request draws from its own generator only."""

from __future__ import annotations

import pytest
import torch

from workers.sampler import RequestSampler, SamplingError, SamplingParams, choose_tokens

LOGITS = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 2.9]])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-300, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-50, seed=1),
    ],
    ids=["zero", "tiny-temperature", "tiny-top_p"],
)
def test_tiny_temperature_or_top_p_is_greedy(params: SamplingParams) -> None:
    sampler = RequestSampler(params)
    assert sampler.greedy
    assert choose_tokens([sampler, sampler], LOGITS) == [1, 0]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_unusable_values_are_refused_naming_the_field(fields: dict, name: str) -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(**fields)
    assert refused.value.field == name and refused.value.status == 400
    assert str(refused.value).startswith(name)


def test_a_seeded_row_draws_the_same_whatever_the_other_rows() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)

    alone = RequestSampler(params).choose(logits[1])
    others = [RequestSampler(SamplingParams()), RequestSampler(SamplingParams(1.0, seed=3))]
    mixed = choose_tokens([others[0], RequestSampler(params), others[1]], logits)

    assert mixed[1] == alone
