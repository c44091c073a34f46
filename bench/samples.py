"""What the benches share: the demo checkpoint they load, one streamed chat request timed at the
client, the nearest-rank quantile they report, and noise pictures no cache can have seen
(distinct, incompressible pixels)."""

from __future__ import annotations

import io
import json
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image

REPO = Path(__file__).resolve().parent.parent


def demo_model_dir() -> Path:
    """MODEL_PATH (relative to the repository), default var/models/demo: built there if absent."""
    path = Path(os.environ.get("MODEL_PATH") or REPO / "var" / "models" / "demo")
    path = path if path.is_absolute() else REPO / path
    if not (path / "config.json").exists():
        from workers.demo_model import build_demo_model

        print(f"building the demo model into {path}")
        build_demo_model(path)
    return path


@dataclass(frozen=True)
class StreamedAnswer:
    """One streamed chat completion as the client saw it (perf_counter times)."""

    sent_at: float
    first_token_at: float  # the first chunk carrying generated text (or the finish reason)
    ended_at: float
    usage: Mapping  # the usage chunk's, when the request asked for it; else empty
    worker: str | None  # X-Routed-Worker (None: the answer did not say)

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.sent_at


def stream_chat(
    client: httpx.Client, base_url: str, body: Mapping, headers: Mapping[str, str] | None = None
) -> StreamedAnswer:
    """POST a streamed chat completion and read it to the end; RuntimeError for an HTTP error, an
    error inside the stream, or a stream without a token."""
    sent_at = time.perf_counter()
    first: float | None = None
    usage: Mapping = {}
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}"
            )
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if first is None and (choice["delta"].get("content") or choice.get("finish_reason")):
                    first = time.perf_counter()
        worker = response.headers.get("X-Routed-Worker")
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return StreamedAnswer(sent_at, first, time.perf_counter(), usage, worker)


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the value at least a fraction q of the sample does not exceed; nan for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def noise_png(seed: int | str, side: int) -> bytes:
    """A side x side PNG of seeded random pixels: no two seeds share a pixel pattern."""
    pixels = random.Random(seed).randbytes(side * side * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (side, side), pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
