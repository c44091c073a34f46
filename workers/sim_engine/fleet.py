"""Many simulated workers in one process (`run_worker --engine sim --count N`): each its own name,
queue, heartbeat, prefix pool and KV events, as N worker processes would have, so a thousand of
them fit on one machine. One clock steps their engines, one thread beats for all of them (one
pipelined round trip per interval), one Celery consumer serves their queues, and each task goes
to the runtime of the queue it came from (`workers.runtime.current_runtime`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import redis
from django.utils import timezone

from routing.contract.kv_events import KvEvent
from routing.fleet.model_cards import republish_if_lost
from routing.fleet.registry import Heartbeat, NameInUse, WorkerRegistry, new_instance_id
from routing.fleet.worker_rows import workers_changed
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.kv.load import LoadTracker
from routing.models import Worker, worker_queue
from routing.prompt.model_card import ModelCard
from workers.kv_cache import KvPool
from workers.runtime import WorkerRuntime, heartbeat_with_load
from workers.sim_engine.clock import SimClock
from workers.sim_engine.engine import SimEngine
from workers.sim_engine.profile import SimProfile

logger = logging.getLogger("workers.sim_engine")

SIM_DEVICE = "sim"


def fleet_names(name: str, count: int) -> list[str]:
    """`name` alone, or `name-0` .. `name-<count-1>`."""
    return [name] if count == 1 else [f"{name}-{i}" for i in range(count)]


class SimFleet:
    """The simulated workers of one process, from registration to deregistration."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        profile: SimProfile,
        clock: SimClock,
        client: redis.Redis,
        namespace: str,
        model_name: str,
        block_size: int,
        heartbeat_ttl_s: float,
        heartbeat_interval_s: float,
        publish_events: bool = True,
        card: ModelCard | None = None,
    ) -> None:
        self.names = list(names)
        self.profile = profile
        self.clock = clock
        self._client = client
        self._namespace = namespace
        self._registry = WorkerRegistry(client, namespace)
        self._index = KvIndex(client, namespace)
        self._load = LoadTracker(client, namespace)
        self._publisher = KvEventPublisher(client, namespace, index=self._index) if publish_events else None
        self._ttl_s = heartbeat_ttl_s
        self._interval_s = heartbeat_interval_s
        self.instance = new_instance_id()  # one process: one instance for all its workers
        self.runtimes: dict[str, WorkerRuntime] = {}  # by queue
        self._heartbeats: dict[str, Heartbeat] = {}
        self._model_name = model_name
        # The model's card when the workers stand in for a checkpoint's (run_worker reads it from
        # the model directory): announced in each heartbeat and kept published, as a real
        # worker's is, so a frontend that cannot see the directory routes the model all the same.
        self._card = card
        self._block_size = block_size
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._epoch = ""

    @property
    def queues(self) -> list[str]:
        return list(self.runtimes)

    def start(self) -> SimFleet:
        """Claims the names (refusing any a live process serves), builds the engines (each
        announces an empty pool), registers the rows and the first beats, and starts beating."""
        predecessors = self._claim()
        publish = self._publisher.publish if self._publisher is not None else None
        host, pid = socket.gethostname(), os.getpid()
        self._epoch = self._index.epoch()
        card = self._card
        for name in self.names:
            if publish is None:
                self._index.purge_worker(name)
            pool = KvPool(
                capacity_blocks=self.profile.kv_capacity_blocks,
                block_size=self._block_size,
                worker=name,
                publish_events=publish,
            )
            engine = SimEngine(
                name=name, model_name=self._model_name, profile=self.profile, pool=pool, clock=self.clock
            )
            self.runtimes[worker_queue(name)] = WorkerRuntime(
                name=name,
                engine=engine,
                client=self._client,
                namespace=self._namespace,
                instance=self.instance,
                model_fingerprint=card.fingerprint if card is not None else "",
            )
            self._heartbeats[name] = Heartbeat(
                name=name,
                model=self._model_name,
                block_size=self._block_size,
                device=SIM_DEVICE,
                pid=pid,
                host=host,
                kv_capacity_blocks=self.profile.kv_capacity_blocks,
                publishes_events=publish is not None,
                instance=self.instance,
                schedule_policy=engine.schedule_policy,
                family=card.family if card is not None else "",
                fingerprint=card.fingerprint if card is not None else "",
            )
            # A dead predecessor's reservations, freed now (run_worker's rule, and its log line):
            # frontends waiting on its requests see the new instance and fail them over at once.
            freed = self._load.free_worker(name)
            if name in predecessors or freed:
                logger.warning(
                    "worker %s: took over from instance %s (%d requests freed)",
                    name,
                    predecessors[name].instance if name in predecessors else "?",
                    freed,
                )
        self._register_rows(host, pid)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="sim-heartbeats", daemon=True)
        self._thread.start()
        return self

    def mark_stopping(self) -> None:
        """SIGTERM: the workers take nothing new but finish what they hold."""
        self._heartbeats = {n: dataclasses.replace(h, stopping=True) for n, h in self._heartbeats.items()}
        self._beat()

    def stop(self) -> None:
        """Stops beating and deregisters this process's workers (only heartbeats still its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        own = [name for name in self.names if self._registry.remove(name, self.instance)]
        Worker.objects.filter(name__in=own, pid=os.getpid()).update(deregistered_at=timezone.now())

    # --- internals ----------------------------------------------------------------------------------
    def _claim(self) -> dict[str, Heartbeat]:
        """run_worker's same-name rule for all the names at once: a heartbeat renewed while we
        watch belongs to a live process (NameInUse); one that does not move is a dead one's."""
        before = {
            n: beat for n, beat in self._registry.alive(self.names).items() if beat.instance != self.instance
        }
        if not before:
            return {}
        time.sleep(self._interval_s * 1.5)
        after = self._registry.alive(before)
        for name, beat in after.items():
            if beat.instance != before[name].instance or beat.beat_at != before[name].beat_at:
                raise NameInUse(beat)
        return before

    def _register_rows(self, host: str, pid: int) -> None:
        now = timezone.now()
        Worker.objects.bulk_create(
            [
                Worker(
                    name=name,
                    role="both",
                    device=SIM_DEVICE,
                    model_name=self._model_name,
                    block_size=self._block_size,
                    host=host,
                    pid=pid,
                    registered_at=now,
                    deregistered_at=None,
                )
                for name in self.names
            ],
            update_conflicts=True,
            unique_fields=["name"],
            update_fields=["role", "device", "model_name", "block_size", "host", "pid", "registered_at",
                           "deregistered_at"],
        )  # fmt: skip
        workers_changed()  # bulk_create sends no signal: every frontend reads the rows again

    def _beat(self) -> None:
        now = time.time()
        beats = [
            heartbeat_with_load(
                dataclasses.replace(self._heartbeats[runtime.name], beat_at=now), runtime.engine
            )
            for runtime in self.runtimes.values()
        ]
        try:
            self._registry.beat_many(beats, self._ttl_s)
            self._reannounce_if_index_lost()
            if self._card is not None:
                republish_if_lost(self._client, self._namespace, self._card)
            self._load.sweep()
        except redis.RedisError:  # the next beat may land before the TTL lapses
            logger.warning("sim fleet: heartbeat failed", exc_info=True)

    def _reannounce_if_index_lost(self) -> None:
        """run_worker's _BlockAnnouncer, once for all the workers of the process."""
        epoch = self._index.epoch()
        if epoch == self._epoch:
            return
        self._epoch = epoch
        if self._publisher is None:
            return
        for runtime in self.runtimes.values():
            blocks = tuple(runtime.engine.kv_block_hashes())
            events = [KvEvent("cleared", runtime.name, ())]
            if blocks:
                events.append(KvEvent("stored", runtime.name, blocks))
            self._publisher.publish(events)
        logger.warning(
            "sim fleet: the KV index was lost; re-announced %d workers' blocks", len(self.runtimes)
        )

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._beat()
