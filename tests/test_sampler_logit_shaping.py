"""Logit bias, presence and frequency penalties and log probabilities, in the per-request sampler
and through the batching engine: a request's options shape only its own row."""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine import GenerationRequest
from workers.sampler import RequestSampler, SamplingError, SamplingParams, choose_tokens

ROW = torch.tensor([1.0, 3.0, 2.5, 0.0])


def test_a_strong_bias_forces_or_forbids_a_token() -> None:
    forced = RequestSampler(SamplingParams(logit_bias=((3, 100.0),)))
    forbidden = RequestSampler(SamplingParams(logit_bias=((1, -100.0),)))
    assert choose_tokens([forced, forbidden], torch.stack([ROW, ROW])) == [3, 2]


def test_frequency_and_presence_penalties_lower_a_repeated_token_by_what_openai_says() -> None:
    sampler = RequestSampler(SamplingParams(presence_penalty=0.2, frequency_penalty=0.1))
    for _ in range(3):
        sampler.counts[1] = sampler.counts.get(1, 0) + 1
    shaped = sampler.shaped(ROW)
    # OpenAI: logit - count * frequency_penalty - (count > 0) * presence_penalty
    assert shaped[1].item() == pytest.approx(3.0 - 3 * 0.1 - 0.2)
    assert torch.equal(shaped[[0, 2, 3]], ROW[[0, 2, 3]])


def test_a_presence_penalty_stops_greedy_repetition() -> None:
    plain = RequestSampler(SamplingParams())
    penalised = RequestSampler(SamplingParams(presence_penalty=1.0))
    rows = torch.stack([ROW, ROW])
    first = choose_tokens([plain, penalised], rows)
    second = choose_tokens([plain, penalised], rows)
    assert first == [1, 1]
    assert second == [1, 2]  # 3.0 - 1.0 < 2.5: the penalised request moves on


def test_logprobs_are_the_shaped_rows_log_softmax_with_the_top_alternatives_in_order() -> None:
    sampler = RequestSampler(SamplingParams(logprobs=True, top_logprobs=3, logit_bias=((0, 1.0),)))
    token = sampler.choose(ROW)
    (chosen,) = sampler.logprobs
    expected = torch.log_softmax(ROW + torch.tensor([1.0, 0, 0, 0]), dim=-1)
    assert token == 1 and chosen.token == 1
    assert chosen.logprob == pytest.approx(expected[1].item())
    assert [t for t, _ in chosen.top] == [1, 2, 0]
    assert [lp for _, lp in chosen.top] == sorted((lp for _, lp in chosen.top), reverse=True)
    assert math.fsum(math.exp(v) for v in expected.tolist()) == pytest.approx(1.0)


def test_a_request_without_options_keeps_the_batch_argmax_beside_one_with_them() -> None:
    plain, biased = RequestSampler(SamplingParams()), RequestSampler(SamplingParams(logit_bias=((0, 50.0),)))
    assert plain.greedy and not biased.greedy
    assert choose_tokens([plain, biased, plain], torch.stack([ROW, ROW, ROW])) == [1, 0, 1]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": ((5, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_shaping_values_name_their_field(fields: dict, name: str) -> None:
    with pytest.raises(SamplingError) as refused:
        SamplingParams(**fields)
    assert refused.value.field == name


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_the_engine_reports_one_logprob_per_completion_token_and_obeys_a_bias(demo_engine) -> None:
    # given the demo engine, and the token it would pick first for this prompt
    engine = demo_engine()
    prompt = chat("Name three rivers.")
    plain = engine.generate(GenerationRequest("r0", prompt, [], max_tokens=6, logprobs=True, top_logprobs=2))

    # then every completion token has its log probability and its two best alternatives
    assert plain.logprobs is not None and len(plain.logprobs) == plain.completion_tokens
    assert "".join(entry["token"] for entry in plain.logprobs).startswith(plain.text[:1] or "")
    for entry in plain.logprobs:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6  # greedy picks the best
        assert bytes(entry["bytes"]).decode() == entry["token"]

    # when the first token is forbidden, the answer changes; a forced token fills the answer
    first = engine.tokenizer.encode(plain.logprobs[0]["token"], add_special_tokens=False)[0]
    other = engine.generate(
        GenerationRequest("r1", prompt, [], max_tokens=6, logit_bias={first: -100.0}, logprobs=True)
    )
    assert other.logprobs[0]["token"] != plain.logprobs[0]["token"]
    assert other.logprobs[0]["token"] == plain.logprobs[0]["top_logprobs"][1]["token"]
    forced_id = engine.tokenizer.encode(" the", add_special_tokens=False)[0]
    forced = engine.generate(GenerationRequest("r2", prompt, [], max_tokens=4, logit_bias={forced_id: 100.0}))
    assert forced.completion_tokens == 4
    assert forced.text == engine.tokenizer.decode([forced_id] * 4)
