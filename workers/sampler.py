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


MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI's penalties: each generated occurrence of a token lowers its logit by
    # frequency_penalty, its first occurrence also by presence_penalty.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: bool = False  # report each chosen token's log probability
    top_logprobs: int = 0  # and this many of the most likely alternatives

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise SamplingError(name, "must be a finite number")
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingError(name, f"must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingError("logit_bias", f"{token!r} is not a token id")
            if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingError("logit_bias", f"the bias of token {token} must be from -100 to 100")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError("top_logprobs", f"must be from 0 to {MAX_TOP_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_p < TOP_TOKEN_ONLY_BELOW

    @property
    def shapes_logits(self) -> bool:
        """Whether the row of logits changes before the choice (bias, penalties)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log probability, and the most likely alternatives at its step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    """One request's token choice. It sees the request's row of logits and its own generated
    tokens (for the penalties), nothing of the other requests in the batch.

    Order, as OpenAI and vLLM apply them: logit bias and penalties shape the row; log
    probabilities are read from the shaped row at temperature 1 (what the model, so steered,
    believes); then temperature and top_p choose (or argmax for a greedy request).
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self.generator.manual_seed(seed % (1 << 64))
        self.counts: dict[int, int] = {}  # generated token -> occurrences (the penalties' input)
        self.logprobs: list[TokenLogprob] = []

    @property
    def greedy(self) -> bool:
        """Chosen by the batch's shared argmax: greedy, and nothing to shape or report."""
        return self.generator is None and not self.params.shapes_logits and not self.params.logprobs

    def shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """The row after logit bias and penalties, on the CPU in float32 (device independent)."""
        row = logits.float().cpu()
        params = self.params
        if params.logit_bias:
            ids = torch.tensor([token for token, _ in params.logit_bias if token < row.shape[-1]])
            biases = torch.tensor([bias for token, bias in params.logit_bias if token < row.shape[-1]])
            if len(ids):
                row = row.clone()
                row[ids] += biases
        if self.counts and (params.presence_penalty or params.frequency_penalty):
            ids = torch.tensor(list(self.counts))
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            row = row.clone()
            row[ids] -= counts * params.frequency_penalty + params.presence_penalty
        return row

    def choose(self, logits: torch.Tensor) -> int:
        row = self.shaped(logits)
        token = int(torch.argmax(row)) if self.generator is None else self._sample(row)
        if self.params.logprobs:
            self.logprobs.append(self._logprob(row, token))
        self.counts[token] = self.counts.get(token, 0) + 1
        return token

    def _logprob(self, row: torch.Tensor, token: int) -> TokenLogprob:
        logprobs = torch.log_softmax(row, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if self.params.top_logprobs:
            values, ids = torch.topk(logprobs, min(self.params.top_logprobs, logprobs.shape[-1]))
            top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token, float(logprobs[token]), top)

    def _sample(self, row: torch.Tensor) -> int:
        # On the CPU in float32, so a seed gives the same tokens whatever the device.
        scaled = row / self.params.temperature
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
    chosen = []
    for row, sampler in enumerate(samplers):
        if sampler.greedy:
            sampler.counts[greedy[row]] = sampler.counts.get(greedy[row], 0) + 1
            chosen.append(greedy[row])
        else:
            chosen.append(sampler.choose(logits[row]))
    return chosen
