"""A simulated engine's timing model and scheduler limits, read from a profile file.

A step's time is linear in what it computes, as a serving engine's is to first order: a fixed
cost per step (kernel launches, sampling, Python), a cost per prompt token prefilled, a cost per
sequence decoding and one per thousand tokens of context those sequences attend to (their KV
read); an image costs one encode the first time its request prefills past it. What it leaves
out: attention's growth with context inside a prefill chunk, and any overlap of encoding with
the step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "cpu-demo"


@dataclass(frozen=True)
class SimProfile:
    name: str
    step_base_ms: float  # every step
    prefill_token_ms: float  # per prompt token computed in the step
    decode_sequence_ms: float  # per sequence whose next token the step computes
    image_encode_ms: float  # per image encoded (once per request, when it first prefills past it)
    max_batch_tokens: int
    max_running: int
    decode_context_ms: float = 0.0  # per 1,000 tokens of context of the decoding sequences
    schedule_policy: str = "shortest_first"
    prefill_join_tokens: int = 64
    kv_capacity_blocks: int = 4096
    # Where the figures come from, and what they were checked against (free-form, kept as read).
    source: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)

    def step_seconds(
        self, prefill_tokens: int, decode_sequences: int, images: int = 0, decode_context: int = 0
    ) -> float:
        """The modelled time of one step, its images' encoding included; `decode_context` is the
        decoding sequences' tokens so far, summed."""
        ms = (
            self.step_base_ms
            + self.prefill_token_ms * prefill_tokens
            + self.decode_sequence_ms * decode_sequences
            + self.decode_context_ms * decode_context / 1000
            + self.image_encode_ms * images
        )
        return ms / 1000.0

    @classmethod
    def from_file(cls, path: Path) -> SimProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimProfile:
        """A profile from a profile file's content."""
        timing, scheduler = data["timing"], data["scheduler"]
        return cls(
            name=data["name"],
            step_base_ms=float(timing["step_base_ms"]),
            prefill_token_ms=float(timing["prefill_token_ms"]),
            decode_sequence_ms=float(timing["decode_sequence_ms"]),
            image_encode_ms=float(timing["image_encode_ms"]),
            decode_context_ms=float(timing.get("decode_context_ms", 0.0)),
            max_batch_tokens=int(scheduler["max_batch_tokens"]),
            max_running=int(scheduler["max_running"]),
            schedule_policy=str(scheduler.get("policy", "shortest_first")),
            prefill_join_tokens=int(scheduler.get("prefill_join_tokens", 64)),
            kv_capacity_blocks=int(data.get("kv_capacity_blocks", 4096)),
            source=data.get("source", {}),
            reference=data.get("reference", {}),
        )


def load_profile(name_or_path: str) -> SimProfile:
    """A shipped profile by name (`profiles/<name>.json`), or a profile file by path."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.json")))
        raise FileNotFoundError(f"no simulator profile {name_or_path!r} (shipped: {shipped})")
    return SimProfile.from_file(path)
