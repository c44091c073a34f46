"""The native engine's running counters, which its heartbeat reports (`EngineLoad`)."""

from __future__ import annotations

from dataclasses import dataclass

# The prefill rate the router drains reservations at is an exponential average over steps that
# computed at least this many prompt tokens: a step of a few decode tokens and a short warm tail
# says more about per-step overhead than about how fast a prompt goes through.
RATE_MIN_PROMPT_TOKENS = 32
_RATE_SMOOTHING = 0.25  # weight of the newest step


@dataclass
class EngineCounters:
    forward_passes: int = 0  # model steps since start
    generated_tokens: int = 0  # tokens chosen since start
    preemptions: int = 0  # requests sent back to waiting because the pool ran dry
    running_peak: int = 0  # the most requests ever in one batch
    prefill_tokens_per_s: float = 0.0
    encoder_seconds: float = 0.0  # spent encoding ahead since the last step that measured the rate

    def note_prefill_rate(self, prompt_tokens: int, seconds: float) -> None:
        rate = prompt_tokens / max(seconds, 1e-6)
        previous = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if previous <= 0 else previous + _RATE_SMOOTHING * (rate - previous)

    def reset(self) -> None:
        """As a new engine's (after the warm-up, whose slow step must not be measured)."""
        self.forward_passes = self.generated_tokens = self.preemptions = self.running_peak = 0
        self.prefill_tokens_per_s = 0.0
        self.encoder_seconds = 0.0
