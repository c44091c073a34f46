"""The media side store: bytes a request needs on its worker (images, later video frames and
encoder embeddings) kept in Redis beside the broker, so the Celery message carries references.

Why: a base64 image inside a task message sits in the broker's memory (and in every copy kombu
makes) for as long as the task is queued; a 16-image burst of phone photos is gigabytes there.
Here each blob is one key with a TTL, and two caps bound what the store may hold: bytes per
request and bytes in total (over either, `put` refuses before writing anything).

Key families, all under the deployment's namespace and owned by this module only:
- `media:blob:<owner>:<n>`: one blob (owner: the request id, or whoever puts it);
- `media:owner:<owner>`: bytes held per owner (the per-request cap), with the blobs' TTL;
- `media:sizes`: a sorted set of `<blob key>|<bytes>` scored by expiry time, and
  `media:total`: the bytes of the live entries. Expired entries are swept from both on each put,
  so the total cap counts only what can still be read.

A reference (`MediaRef`) travels in the task as `{"media_ref": key, "media_bytes": n}` (the fields
of `routing.contract.tasks.ImageRef`). A reader gets
the bytes with `get` (one round trip for many with `get_many`); a reference whose blob is gone
(expired, released, never stored) is `MediaMissing`, at once: never a wait.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from routing.state.lua import aevalsha, lua_text

if TYPE_CHECKING:
    from routing.state.redis_direct import AsyncDirectCommands

BLOB_FAMILY = "media:blob:"
OWNER_FAMILY = "media:owner:"
SIZES_KEY = "media:sizes"
TOTAL_KEY = "media:total"

DEFAULT_TTL_S = 600.0
DEFAULT_MAX_REQUEST_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_TOTAL_BYTES = 2 * 1024 * 1024 * 1024

# Both scripts in routing/media/lua/.
_PUT = lua_text(__package__, "store_put.lua")
_RELEASE = lua_text(__package__, "store_release.lua")


class MediaStoreError(Exception):
    """The store refused or lost a blob; `status` and `code` are what the API should answer."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class MediaTooLarge(MediaStoreError):
    """One request's media is over the per-request cap: the client's request is too big."""

    def __init__(self, message: str) -> None:
        super().__init__(413, "media_too_large", message)


class MediaStoreFull(MediaStoreError):
    """The store as a whole is at its cap: the platform is busy, the client may retry."""

    def __init__(self, message: str) -> None:
        super().__init__(503, "media_store_full", message)


class MediaMissing(MediaStoreError):
    """A reference whose blob is gone: expired, released, or never stored."""

    def __init__(self, message: str) -> None:
        super().__init__(503, "media_missing", message)


@dataclass(frozen=True)
class MediaRef:
    """Where a blob is, and how big it is; what the task carries instead of the bytes."""

    key: str
    size: int

    def to_payload(self) -> dict[str, Any]:
        return {"media_ref": self.key, "media_bytes": self.size}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> MediaRef:
        return cls(str(payload["media_ref"]), int(payload["media_bytes"]))

    @staticmethod
    def in_payload(payload: Mapping[str, Any]) -> bool:
        return payload.get("media_ref") is not None


_counter = itertools.count()


class MediaStore:
    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self.ttl_s = ttl_s
        self.max_request_bytes = max_request_bytes
        self.max_total_bytes = max_total_bytes
        self._put = client.register_script(_PUT)
        self._release = client.register_script(_RELEASE)

    def _key(self, family: str, suffix: str) -> str:
        return f"{self._namespace}{family}{suffix}"

    def put(self, owner: str, blob: bytes) -> MediaRef:
        """Store one blob for `owner` (a request id); MediaTooLarge / MediaStoreFull over a cap."""
        # Unique across the processes that may put for one owner (frontend, encoder workers).
        key = self._key(BLOB_FAMILY, f"{owner}:{os.getpid()}-{next(_counter)}")
        verdict, held = self._put(
            keys=[
                key,
                self._key(OWNER_FAMILY, owner),
                self._key("", SIZES_KEY),
                self._key("", TOTAL_KEY),
            ],
            args=[
                blob,
                len(blob),
                max(1, int(self.ttl_s * 1000)),
                int(time.time() * 1000),
                self.max_request_bytes,
                self.max_total_bytes,
            ],
        )
        if verdict == 1:
            raise MediaTooLarge(
                f"the request's media would be {int(held) + len(blob)} bytes, over the "
                f"{self.max_request_bytes}-byte limit per request"
            )
        if verdict == 2:
            raise MediaStoreFull(
                f"the media store holds {int(held)} bytes and cannot take {len(blob)} more "
                f"(limit {self.max_total_bytes}); retry shortly"
            )
        return MediaRef(key, len(blob))

    def put_many(self, owner: str, blobs: Sequence[bytes]) -> list[MediaRef]:
        """Store several blobs for one owner; if one is refused, those already stored are freed."""
        refs: list[MediaRef] = []
        try:
            for blob in blobs:
                refs.append(self.put(owner, blob))
        except BaseException:
            if refs:
                self.release(owner, refs)
            raise
        return refs

    def get(self, ref: MediaRef) -> bytes:
        return self.get_many([ref])[0]

    def get_many(self, refs: Sequence[MediaRef]) -> list[bytes]:
        """The blobs, in order, in one round trip; MediaMissing names the first one gone."""
        if not refs:
            return []
        blobs = self._client.mget([ref.key for ref in refs])
        for ref, blob in zip(refs, blobs, strict=True):
            if blob is None:
                raise MediaMissing(
                    f"media {ref.key.rpartition(BLOB_FAMILY)[2]} is no longer stored (released, or "
                    f"expired after {self.ttl_s:g} s); retry the request"
                )
            if len(blob) != ref.size:
                raise MediaMissing(f"media {ref.key} holds {len(blob)} bytes, not the {ref.size} referenced")
        return list(blobs)

    def release(self, owner: str, refs: Sequence[MediaRef]) -> int:
        """Free an owner's blobs at once (they would expire anyway); returns the bytes freed."""
        keys, args = self._release_inputs(owner, refs)
        return int(self._release(keys=keys, args=args))

    async def arelease(self, lines: AsyncDirectCommands, owner: str, refs: Sequence[MediaRef]) -> int:
        """`release` on an event loop's own connections (`lines`, to this store's Redis)."""
        keys, args = self._release_inputs(owner, refs)
        return int(await aevalsha(lines, self._release.sha, self._release.script, len(keys), *keys, *args))

    def _release_inputs(self, owner: str, refs: Sequence[MediaRef]) -> tuple[list[str], list[str]]:
        keys = [
            self._key("", SIZES_KEY),
            self._key("", TOTAL_KEY),
            self._key(OWNER_FAMILY, owner),
            *(ref.key for ref in refs),
        ]
        return keys, [f"{ref.key}|{ref.size}" for ref in refs]

    def total_bytes(self) -> int:
        return int(self._client.get(self._key("", TOTAL_KEY)) or 0)


def media_store_from_settings(client: redis.Redis, namespace: str, settings: Any) -> MediaStore:
    """The deployment's store, from the MEDIA_STORE_* settings (passed in: no Django import here)."""
    return MediaStore(
        client,
        namespace,
        ttl_s=settings.MEDIA_STORE_TTL_SECS,
        max_request_bytes=settings.MEDIA_STORE_MAX_REQUEST_BYTES,
        max_total_bytes=settings.MEDIA_STORE_MAX_TOTAL_BYTES,
    )
