"""Fixtures shared by the whole suite.

Tests talk to the real Redis (TEST_REDIS_URL, default database 13 on the local server) and
each test works inside a key namespace of its own, removing only the keys it wrote.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")


@pytest.fixture
def redis_url() -> str:
    return TEST_REDIS_URL


@pytest.fixture
def key_namespace() -> str:
    """A key prefix no other test (or deployment) uses."""
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def redis_client(redis_url: str, key_namespace: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.ping()
    yield client
    for key in client.scan_iter(match=f"{key_namespace}*", count=1000):
        client.delete(key)
    client.close()
