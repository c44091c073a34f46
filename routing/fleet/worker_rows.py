"""The operator's side of each worker (its name, `enabled`, `draining`) as every frontend reads it
for each request: kept in the process under a generation in Redis, not queried each time.

A frontend decides per request which workers may take it; the query for the rows cost it 0.7 ms
of CPU each time, where the heartbeats' MGET costs 0.1-0.2 ms. Every change to a
Worker row (a save, a delete, an `update()` of a queryset, as the admin's drain and enable
actions do) sets a new generation in Redis once it is committed. A frontend reads the generation
in the same MGET as the workers' heartbeats and reads the rows again only when it has moved, so
a disable or a drain in the admin still reaches every frontend at its next request.

The generation is a random token (routing.state.redis_keys.read_generation and renew_generation).
A change made around Django (a database edited by hand) is picked up within MAX_AGE_S.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis

from routing.state.expiring import ExpiringLru
from routing.state.redis_keys import read_generation, redact_text, renew_generation, sync_client

logger = logging.getLogger("routing.fleet.worker_rows")

GENERATION_KEY = "workers:generation"
# The longest a frontend keeps rows without reading them again, whatever the generation says.
MAX_AGE_S = 10.0


@dataclass(frozen=True)
class WorkerRow:
    name: str
    enabled: bool
    draining: bool
    model_name: str = ""  # the model it announced at registration ("": not registered yet)

    def may_serve(self, model: str) -> bool:
        """Whether its heartbeat is worth reading for a request for `model`: a request reads only
        its model's workers' keys (a row not registered yet is read: its heartbeat says)."""
        return self.model_name in (model, "")


class KeptRows:
    """This process's rows, with the generation they were read under, for at most `max_age_s`."""

    def __init__(self, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] | None = None) -> None:
        self.max_age_s = max_age_s
        self._entry: ExpiringLru[tuple[bytes, tuple[WorkerRow, ...]]] = ExpiringLru(1, clock)

    def get(self) -> tuple[bytes, tuple[WorkerRow, ...]] | None:
        """The rows' generation and the rows, unless none are kept or they are too old to trust."""
        return self._entry.get(None)

    def put(self, generation: bytes, rows: tuple[WorkerRow, ...]) -> None:
        self._entry.put(None, (generation, rows), self.max_age_s)

    def clear(self) -> None:
        self._entry.clear()


_kept = KeptRows()


def kept_rows() -> KeptRows:
    return _kept


def current_generation(client: redis.Redis, namespace: str) -> bytes:
    """The generation now (routing.state.redis_keys.read_generation)."""
    return read_generation(client, f"{namespace}{GENERATION_KEY}")


def announce_change(client: redis.Redis, namespace: str) -> None:
    """Every frontend reads the rows again at its next request."""
    renew_generation(client, f"{namespace}{GENERATION_KEY}")


def workers_changed() -> None:
    """A Worker row changed: this process forgets its rows now, every other frontend once the
    change is committed (one that learned of it earlier could read the old row again and keep
    it under the new generation). routing.apps wires this to every save and delete, and
    routing.models.WorkerQuerySet to every update()."""
    from django.db import transaction

    _kept.clear()
    transaction.on_commit(_announce)


def _announce() -> None:
    from django.conf import settings

    _kept.clear()
    try:
        announce_change(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    except redis.RedisError as exc:
        # Without Redis no frontend routes anything; they read the rows again within MAX_AGE_S.
        logger.warning("could not announce a change to the workers: %s", redact_text(str(exc)))
