"""Where a request's sampled video frames wait for the worker: Redis, keyed by the video's
identity, with a TTL. The task carries the key, never the frames (a Celery message stays small).

A stand-in with the media side store's shape (put bytes, get a reference; fetch by reference):
when the shared media side store lands, videos move to it and this module goes.
"""

from __future__ import annotations

import redis

FRAMES_FAMILY = "vframes:"


def frames_key(namespace: str, identity: str) -> str:
    return f"{namespace}{FRAMES_FAMILY}{identity}"


def put_frames(client: redis.Redis, namespace: str, identity: str, frames: bytes, ttl_s: int) -> str:
    """Stores a video's frames (once per identity: a repeat only renews them); returns the key."""
    key = frames_key(namespace, identity)
    if not client.expire(key, ttl_s):
        client.set(key, frames, ex=ttl_s)
    return key


def get_frames(client: redis.Redis, key: str) -> bytes | None:
    value = client.get(key)
    return None if value is None else bytes(value)
