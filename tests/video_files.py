"""Test clips made here with PyAV (no downloads): moving patterns, and the hostile files a video
endpoint must refuse (truncated, endless, huge, empty, a playlist that points elsewhere)."""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import numpy as np


def clip_frames(frames: int, width: int, height: int, *, seed: int = 0) -> list[np.ndarray]:
    """Frames of a pattern that moves, so every frame differs and sampling shows in the pixels."""
    rng = np.random.default_rng(seed)
    # Blocks of 8x8 pixels: a picture with edges, compressible as real footage is.
    blocks = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    base = blocks.repeat(8, axis=0).repeat(8, axis=1)[:height, :width]
    return [np.roll(base, shift=(n * 3) % max(width, 1), axis=1) for n in range(frames)]


def make_clip(
    frames: int = 24,
    width: int = 64,
    height: int = 48,
    fps: int | Fraction = 12,
    *,
    container: str = "mp4",
    codec: str = "libx264",
    seed: int = 0,
) -> bytes:
    """An encoded clip (H.264 in MP4 by default) of `frames` frames."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if codec not in ("mjpeg",) else "yuvj420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast"}
        for image in clip_frames(frames, width, height, seed=seed):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def faststart_clip(frames: int = 48, width: int = 64, height: int = 48, fps: int = 12) -> bytes:
    """An MP4 with its index first (as streamed files are): cut short, it still declares every frame."""
    import tempfile
    from pathlib import Path

    import av

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "clip.mp4"  # faststart rewrites the file: it needs a real one
        with av.open(str(path), mode="w", options={"movflags": "faststart"}) as output:
            stream = output.add_stream("libx264", rate=fps)
            stream.width, stream.height = width, height
            stream.pix_fmt = "yuv420p"
            stream.options = {"preset": "ultrafast"}
            for image in clip_frames(frames, width, height):
                for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                    output.mux(packet)
            for packet in stream.encode():
                output.mux(packet)
        return path.read_bytes()


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def empty_clip() -> bytes:
    """A container with a video stream and not one frame in it."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="matroska") as output:
        stream = output.add_stream("mpeg4", rate=10)
        stream.width, stream.height = 64, 48
        stream.pix_fmt = "yuv420p"
    return buffer.getvalue()


def huge_frame_clip(width: int = 4096, height: int = 4096) -> bytes:
    """Two flat frames of a size over the default per-frame limit: small on the wire, huge decoded."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="matroska") as output:
        stream = output.add_stream("libx264", rate=1)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "ultrafast"}
        flat = np.zeros((height, width, 3), dtype=np.uint8)
        for _ in range(2):
            for packet in stream.encode(av.VideoFrame.from_ndarray(flat, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def endless_stream(frames: int, width: int = 16, height: int = 16) -> bytes:
    """An MPEG-TS stream (no frame count in its header: a live stream's shape) of many frames."""
    return make_clip(frames, width, height, fps=25, container="mpegts", codec="mpeg4")


def playlist_pointing_at(url: str) -> bytes:
    """An HLS playlist: a demuxer that would open another URL by itself."""
    return f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1.0,\n{url}\n#EXT-X-ENDLIST\n".encode()
