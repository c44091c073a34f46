"""How each request in a batch chooses its next token from its own row of logits.

Every request has its own `RequestSampler` (its parameters and, when it samples, its own seeded
generator), so what a request draws never depends on what else shares its batch. Greedy rows
are chosen together with one argmax over the batch.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

# Below this temperature a request is greedy, as OpenAI clients expect of temperature 0; dividing
# logits by a tiny temperature would overflow to inf and make NaN probabilities.
GREEDY_BELOW = 1e-5
# A top_p this small keeps only the most likely token.
TOP_TOKEN_ONLY_BELOW = 1e-5
MAX_TEMPERATURE = 2.0


class SamplingError(ValueError):
    """A sampling parameter the engine cannot use; names the field (answered as a 400)."""

    status = 400
    code = "invalid_request"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_p < TOP_TOKEN_ONLY_BELOW


def check_sampling(temperature: object, top_p: object, seed: object) -> None:
    """Raises `SamplingError` naming the first field that is not a usable value."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise SamplingError("temperature", "must be a number")
    if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise SamplingError("temperature", f"must be a finite number between 0 and {MAX_TEMPERATURE:g}")
    if isinstance(top_p, bool) or not isinstance(top_p, int | float):
        raise SamplingError("top_p", "must be a number")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise SamplingError("top_p", "must be a finite number in (0, 1]")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise SamplingError("seed", "must be an integer")


class RequestSampler:
    """One request's token choice. Extend here (logprobs, penalties): it sees the request's row
    of logits and its own generated tokens, nothing of the other requests in the batch."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator.manual_seed(seed % (1 << 64))

    @property
    def greedy(self) -> bool:
        return self.generator is None

    def choose(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits))
        # On the CPU in float32, so a seed gives the same tokens whatever the device.
        scaled = logits.float().cpu() / self.params.temperature
        probabilities = torch.softmax(scaled, dim=-1)
        if self.params.top_p < 1.0:
            ordered, order = torch.sort(probabilities, descending=True)
            # Keep the smallest head whose mass reaches top_p (the first token always stays).
            outside = torch.cumsum(ordered, dim=-1) - ordered >= self.params.top_p
            ordered[outside] = 0.0
            probabilities = torch.zeros_like(probabilities).scatter_(0, order, ordered)
        return int(torch.multinomial(probabilities, 1, generator=self.generator))


def choose_tokens(samplers: list[RequestSampler], logits: torch.Tensor) -> list[int]:
    """The next token of each request, row i for samplers[i]: greedy rows in one argmax."""
    greedy = logits.argmax(dim=-1).tolist()
    return [
        greedy[row] if sampler.greedy else sampler.choose(logits[row]) for row, sampler in enumerate(samplers)
    ]
