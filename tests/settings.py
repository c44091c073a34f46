"""Settings for the test suite: the platform's own, on the test Redis database and a session prefix.

Anything the in-process code writes to Redis (Celery broker keys included) lands under this
prefix on database 13, and the session removes it at the end.
"""

import os
import uuid

os.environ.setdefault("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
os.environ["REDIS_URL"] = os.environ["TEST_REDIS_URL"]
os.environ.pop("CELERY_BROKER_URL", None)
os.environ["REDIS_KEY_PREFIX"] = f"test:session-{uuid.uuid4().hex[:8]}:"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("DATABASE_URL", None)

from inference_platform.settings import *  # noqa: F403
