"""Video parts of a request, decoded in the frontend: fetched through the guarded fetcher, decoded
with PyAV (its bundled FFmpeg), sampled as the model family samples, and hashed by content.

Frontend decoding is what makes video routing exact (as in Dynamo): the identity is a hash of the
sampled, decoded frames, so the same clip behind two URLs routes alike, and the frames (resized to
what the model's processor would resize them to) are what the worker gets; it never refetches.
Every limit is a setting, and a refusal names the limit it hit.
"""

from __future__ import annotations

import base64
import binascii
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from io import BytesIO

import xxhash

from routing.media.images import MediaError, MediaPolicy, fetch_bytes, is_data_url, routing_hash
from routing.prompt.video_layouts import QwenVideoLayout, VideoExpansion, VideoRefused

# Demuxers allowed on untrusted bytes: the containers clips come in. Never playlists or
# concatenation (hls, concat, ...), which open further URLs or files on their own.
VIDEO_FORMATS = ("mov", "mp4", "m4a", "3gp", "3g2", "mj2", "matroska", "webm", "avi", "mpegts", "gif")
# How much FFmpeg may read to identify the container and its streams.
_PROBE_BYTES = 5_000_000
_PROBE_MICROSECONDS = 5_000_000


@dataclass(frozen=True)
class VideoLimits:
    """What the frontend agrees to fetch and decode (settings VIDEO_*; DYN_MM_MAX_FILE_SIZE_MB)."""

    max_duration_s: float = 600.0
    max_frames: int = 36_000  # frames in the clip
    max_pixels_per_frame: int = 3840 * 2160
    max_total_pixels: int = 256 * 1024 * 1024  # over the sampled frames, as decoded and as resized
    deadline_s: float = 30.0  # fetch and decode of one clip
    decode_cache_bytes: int = 256 * 1024 * 1024  # recent decodes kept by content (0: none)


@dataclass(frozen=True)
class SampledVideo:
    """One video of a request: its identity, the frames kept, and how they enter the prompt."""

    index: int
    url: str
    identity: str
    routing_hash: int
    width: int  # of the decoded frames
    height: int
    fps: float
    total_frames: int
    indices: tuple[int, ...]  # the frames kept
    expansion: VideoExpansion
    # The kept frames resized to the expansion's size: RGB, uint8, frame after frame.
    frames: bytes = field(repr=False)
    decode_ms: float = 0.0

    @property
    def frame_shape(self) -> tuple[int, int, int, int]:
        """(frames, height, width, channels) of `frames`."""
        return (len(self.indices), self.expansion.resized_height, self.expansion.resized_width, 3)


def _refused(status: int, code: str, message: str) -> MediaError:
    return MediaError(status, code, message)


# --- the bytes -----------------------------------------------------------------------------------
def decode_video_data_url(url: str, *, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:video/...` URL; anything else is refused."""
    header, comma, payload = url[5:].partition(",")
    params = [part.strip().lower() for part in header.split(";")]
    if not comma or not params[0].startswith("video/"):
        raise _refused(400, "invalid_data_url", "data URL is not a video (expected data:video/...;base64,)")
    if "base64" not in params[1:]:
        raise _refused(400, "invalid_data_url", "data URL is not base64-encoded")
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise _refused(413, "video_too_large", f"data URL video is over the {max_bytes}-byte limit")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _refused(400, "invalid_data_url", "data URL holds invalid base64") from None
    if not data:
        raise _refused(400, "invalid_data_url", "data URL is empty")
    if len(data) > max_bytes:
        raise _refused(413, "video_too_large", f"data URL video is over the {max_bytes}-byte limit")
    return data


def fetch_video_bytes(url: str, policy: MediaPolicy) -> bytes:
    """A clip's bytes: a data URL's, or an http(s) GET through the SSRF guard and size cap."""
    if is_data_url(url):
        return decode_video_data_url(url, max_bytes=policy.max_bytes)
    return fetch_bytes(url, policy, headers={"Accept": "video/*"})


# --- decoding ------------------------------------------------------------------------------------
# (indices kept, fps, total frames, width, height, identity, expansion, resized frames)
Decoded = tuple[tuple[int, ...], float, int, int, int, str, VideoExpansion, bytes]


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise _refused(
                422,
                "video_decode_timeout",
                f"video took longer than VIDEO_DECODE_DEADLINE_SECS={self.seconds:g} s to fetch and decode",
            )


def _open(data: bytes):
    import av

    try:
        container = av.open(
            BytesIO(data),
            mode="r",
            options={
                "format_whitelist": ",".join(VIDEO_FORMATS),
                "probesize": str(_PROBE_BYTES),
                "analyzeduration": str(_PROBE_MICROSECONDS),
            },
            metadata_errors="ignore",
        )
    except (av.FFmpegError, ValueError, OSError, UnicodeError, IndexError) as exc:
        raise _refused(
            400, "video_undecodable", f"video bytes are not a supported video ({_reason(exc)})"
        ) from None
    return container


def _reason(exc: BaseException) -> str:
    text = str(exc).split(":", 1)[0] if str(exc) else type(exc).__name__
    return text[:120]


def _frame_rate(stream) -> float:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate is not None and rate > 0:
            return float(rate)
    raise _refused(400, "video_undecodable", "the video declares no frame rate")


def _count_frames(container, stream, limits: VideoLimits, deadline: _Deadline) -> int:
    """Frames in the video stream by demuxing (no decoding): for containers that do not say."""
    count = 0
    for packet in container.demux(stream):
        if packet.size:
            count += 1
            if count > limits.max_frames:
                raise _over_frames(limits)
            if count % 64 == 0:
                deadline.check()
    return count


def _over_frames(limits: VideoLimits) -> MediaError:
    return _refused(413, "video_too_long", f"video has more than VIDEO_MAX_FRAMES={limits.max_frames} frames")


def _check_limits(total: int, fps: float, width: int, height: int, limits: VideoLimits) -> None:
    if width * height > limits.max_pixels_per_frame:
        raise _refused(
            413,
            "video_frame_too_large",
            f"video frames are {width}x{height} = {width * height} pixels, over "
            f"VIDEO_MAX_PIXELS_PER_FRAME={limits.max_pixels_per_frame}",
        )
    if total > limits.max_frames:
        raise _over_frames(limits)
    duration = total / fps
    if duration > limits.max_duration_s:
        raise _refused(
            413,
            "video_too_long",
            f"video lasts {duration:.1f} s, over VIDEO_MAX_DURATION_SECS={limits.max_duration_s:g}",
        )


def _check_total_pixels(pixels: int, limits: VideoLimits) -> None:
    if pixels > limits.max_total_pixels:
        raise _refused(
            413,
            "video_too_large",
            f"the sampled frames hold {pixels} pixels, over VIDEO_MAX_TOTAL_PIXELS={limits.max_total_pixels}",
        )


def decode_video(
    data: bytes, layout: QwenVideoLayout, limits: VideoLimits, *, deadline: _Deadline | None = None
) -> Decoded:
    """Sample and decode a clip: (indices, fps, total frames, width, height, identity, expansion,
    resized frames). Anything FFmpeg cannot read, or any limit crossed, is a MediaError (4xx)."""
    import av
    from PIL import Image

    deadline = deadline or _Deadline(limits.deadline_s)
    container = _open(data)
    try:
        if container.format.name.split(",")[0] not in VIDEO_FORMATS:  # belt and braces over the whitelist
            raise _refused(
                400, "video_undecodable", f"video container {container.format.name} is not accepted"
            )
        if not container.streams.video:
            raise _refused(400, "video_undecodable", "the file holds no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width < 1 or height < 1:
            raise _refused(
                400, "video_undecodable", f"the video stream declares an empty size {width}x{height}"
            )
        fps = _frame_rate(stream)
        if width * height > limits.max_pixels_per_frame:
            _check_limits(0, fps, width, height, limits)
        total = int(stream.frames or 0)
        if total <= 0:
            total = _count_frames(container, stream, limits, deadline)
            container.close()
            container = _open(data)
            stream = container.streams.video[0]
        if total <= 0:
            raise _refused(400, "video_no_frames", "the video has no frames")
        _check_limits(total, fps, width, height, limits)
        try:
            indices = layout.sample_indices(total, fps)
            expansion = layout.expansion(indices, fps, width, height)
        except VideoRefused as exc:
            raise _refused(400, "video_refused", str(exc)) from None
        _check_total_pixels(len(indices) * width * height, limits)
        _check_total_pixels(len(indices) * expansion.resized_width * expansion.resized_height, limits)
        stream.thread_type = "AUTO"
        # The decoder itself refuses a frame over the limit: a stream that grows mid-way is not
        # allocated at its new size first and checked after.
        stream.codec_context.options = {"max_pixels": str(limits.max_pixels_per_frame)}

        digest = xxhash.xxh3_128()
        digest.update(f"video\0{fps!r}\0{total}\0{width}x{height}\0{','.join(map(str, indices))}\0".encode())
        wanted = iter(indices)
        next_index = next(wanted)
        resized: list[bytes] = []
        target = (expansion.resized_width, expansion.resized_height)
        decoded = 0
        for frame in container.decode(stream):
            if decoded % 16 == 0:
                deadline.check()
            if decoded == next_index:
                if (frame.width, frame.height) != (width, height):  # the processor stacks frames
                    raise _refused(
                        400,
                        "video_undecodable",
                        f"the video changes size, {width}x{height} to {frame.width}x{frame.height}",
                    )
                rgb = frame.to_image()  # RGB24, decoded
                digest.update(rgb.tobytes())
                resized.append(rgb.resize(target, Image.Resampling.BICUBIC).tobytes())
                next_index = next(wanted, None)
                if next_index is None:
                    break
            decoded += 1
            if decoded > limits.max_frames:
                raise _over_frames(limits)
        if next_index is not None:
            raise _refused(
                400,
                "video_truncated",
                f"the video declares {total} frames but only {decoded} decode: it is truncated or corrupt",
            )
    except av.FFmpegError as exc:
        raise _refused(400, "video_undecodable", f"the video could not be decoded ({_reason(exc)})") from None
    except (ValueError, OSError, UnicodeError, IndexError, MemoryError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise _refused(400, "video_undecodable", f"the video could not be decoded ({_reason(exc)})") from None
    finally:
        container.close()
    return tuple(indices), fps, total, width, height, digest.hexdigest(), expansion, b"".join(resized)


class DecodeCache:
    """Recent decodes by the clip's bytes (and the settings that shaped them), so several questions
    about one video decode it once per frontend process; bounded by the frames' bytes."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple, Decoded] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def get(self, key: tuple) -> Decoded | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return found

    def put(self, key: tuple, decoded: Decoded, capacity: int) -> None:
        size = len(decoded[7])
        with self._lock:
            if size > capacity or key in self._entries:
                return
            while self._entries and self._bytes + size > capacity:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted[7])
            self._entries[key] = decoded
            self._bytes += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


DECODE_CACHE = DecodeCache()


def _decode_cached(data: bytes, layout: QwenVideoLayout, limits: VideoLimits, deadline: _Deadline) -> Decoded:
    if limits.decode_cache_bytes <= 0:
        return decode_video(data, layout, limits, deadline=deadline)
    # The bytes' own hash: the same clip from any URL, and a changed origin is a new entry.
    key = (xxhash.xxh3_128_hexdigest(data), len(data), layout, limits)
    found = DECODE_CACHE.get(key)
    if found is None:
        found = decode_video(data, layout, limits, deadline=deadline)
        DECODE_CACHE.put(key, found, limits.decode_cache_bytes)
    return found


def sample_video(
    index: int, url: str, policy: MediaPolicy, layout: QwenVideoLayout, limits: VideoLimits
) -> SampledVideo:
    """Fetch (guarded), decode, sample and hash one clip; a MediaError names the video."""
    started = time.perf_counter()
    deadline = _Deadline(limits.deadline_s)
    try:
        data = fetch_video_bytes(url, policy)
        deadline.check()
        indices, fps, total, width, height, identity, expansion, frames = _decode_cached(
            data, layout, limits, deadline
        )
    except MediaError as error:
        raise MediaError(error.status, error.code, f"video {index}: {error.message}") from None
    return SampledVideo(
        index=index,
        url=url,
        identity=identity,
        routing_hash=routing_hash(identity),
        width=width,
        height=height,
        fps=fps,
        total_frames=total,
        indices=indices,
        expansion=expansion,
        frames=frames,
        decode_ms=(time.perf_counter() - started) * 1000,
    )


_DEFAULT_EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="video")  # threads start on use


def resolve_videos(
    urls: Sequence[str],
    policy: MediaPolicy,
    layout: QwenVideoLayout | None,
    limits: VideoLimits,
    *,
    executor: Executor | None = None,
) -> list[SampledVideo]:
    """Every video of a request, decoded on the thread pool; the first failure (in request order)
    raises. Without a video layout the model takes no video: 400."""
    if not urls:
        return []
    if layout is None:
        raise MediaError(400, "video_unsupported", "this model does not take video input")
    pool = executor or _DEFAULT_EXECUTOR
    futures: list[Future[SampledVideo]] = [
        pool.submit(sample_video, index, url, policy, layout, limits) for index, url in enumerate(urls)
    ]
    try:
        return [future.result() for future in futures]
    finally:
        for future in futures:
            future.cancel()
