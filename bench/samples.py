"""What the platform benches share: the nearest-rank quantile they report, and noise pictures no
cache can have seen (distinct, incompressible pixels)."""

from __future__ import annotations

import io
import random
from collections.abc import Sequence

from PIL import Image


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
