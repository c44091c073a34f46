"""`manage.py run_worker --name gpu0 --device cuda:0 [--role both|llm|encode]`: one GPU worker process.

Roles (E/PD): `both` (the default) encodes its own images and generates; `llm` generates from
features encode workers send, and drops its vision tower until a fallback needs it; `encode`
loads only the vision tower and projector and serves the `workers.encode` task.

It loads the model once, registers itself (the admin's Worker row plus a Redis heartbeat with
a TTL), then consumes only the Celery queue `worker.<name>` with a thread pool (the model is
never forked). SIGTERM finishes the running requests, deregisters and exits; SIGKILL leaves the
heartbeat to lapse, which drops the worker from the live set on its own.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from routing.contract.kv_events import KvEvent
from routing.contract.tasks import ROLE_BOTH, ROLE_ENCODE, ROLE_LLM, ROLES
from routing.deployment import statistics_namespace
from routing.fleet.encoders import EncoderPool
from routing.fleet.model_cards import publish_card, republish_if_lost
from routing.fleet.registry import Heartbeat, NameInUse, WorkerRegistry, new_instance_id
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.kv.load import LoadTracker
from routing.media.store import media_store_from_settings
from routing.models import Model, Worker, worker_queue
from routing.observe import telemetry
from routing.observe.cache_stats import CacheStats
from routing.prompt.model_card import read_model_card
from routing.state.redis_keys import redact_url, sync_client
from workers.runtime import heartbeat_with_load

logger = logging.getLogger("workers.run_worker")

ENGINE_NATIVE = "native"
ENGINE_VLLM = "vllm"
ENGINE_SIM = "sim"
ENGINES = (ENGINE_NATIVE, ENGINE_VLLM, ENGINE_SIM)


class Command(BaseCommand):
    help = "Run one GPU worker process: load the model, register, and serve its own Celery queue."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--name", required=True, help="Worker name; it consumes the queue worker.<name>.")
        parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu).")
        parser.add_argument("--model-path", default=None, help="Model directory (default: MODEL_PATH).")
        parser.add_argument(
            "--model-name",
            default=None,
            help="The name clients send as `model` (default: MODEL_NAME for MODEL_PATH, else the "
            "model directory's name).",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=settings.WORKER_CONCURRENCY,
            help="Requests accepted at once (Celery threads): the engine batches up to ENGINE_MAX_RUNNING "
            "of them, the rest wait in its queue.",
        )
        parser.add_argument(
            "--no-kv-events",
            action="store_true",
            help="Publish no KV events; the router then credits this worker with what it routed there "
            "(approximate mode, ROUTER_APPROXIMATE_TTL_SECS).",
        )
        parser.add_argument(
            "--threads",
            type=int,
            default=int(os.environ.get("WORKER_TORCH_THREADS", "0")),
            help="torch CPU threads (0: torch's default). Use 1 when several workers share a CPU.",
        )
        parser.add_argument(
            "--role",
            choices=ROLES,
            default=ROLE_BOTH,
            help="both: encode and generate (default); llm: generate from encode workers' features; "
            "encode: vision tower and projector only, computing image features for llm workers.",
        )

        parser.add_argument(
            "--engine",
            choices=ENGINES,
            default=ENGINE_NATIVE,
            help="native: the platform's own engine (default); vllm: vLLM's AsyncLLM in this process, "
            "run from the vLLM virtualenv (`make vllm`, then .venv-vllm/bin/python manage.py run_worker); "
            "sim: no model, a timing model over a real prefix pool (workers.sim_engine), --count per process",
        )
        parser.add_argument(
            "--count",
            type=int,
            default=1,
            help="--engine sim: simulated workers in this process, named <name>-0 .. <name>-<count-1> "
            "(1: <name>), each with its own queue, heartbeat and prefix pool.",
        )
        parser.add_argument(
            "--sim-profile",
            default=os.environ.get("SIM_PROFILE", "cpu-demo"),
            help="--engine sim: a profile shipped in workers/sim_engine/profiles (by name) or a JSON file.",
        )
        parser.add_argument(
            "--sim-speedup",
            type=float,
            default=float(os.environ.get("SIM_SPEEDUP", "1")),
            help="--engine sim: simulated seconds per wall second (scaled real time; <1 slows the "
            "simulation down so a busy process keeps up with many engines).",
        )
        parser.add_argument(
            "--sim-kv-blocks",
            type=int,
            default=None,
            help="--engine sim: each simulated worker's KV pool, in blocks of KV_BLOCK_SIZE (default: "
            "the profile's kv_capacity_blocks), to give it a native worker's KV_CAPACITY_BLOCKS, say.",
        )
        parser.add_argument(
            "--kv-cache-mb",
            type=int,
            default=int(os.environ.get("VLLM_KV_CACHE_MB", "256")),
            help="--engine vllm: the KV cache's size in MiB (vLLM's kv_cache_memory_bytes; default "
            "VLLM_KV_CACHE_MB or 256). Explicit, so engines sharing a machine never guess.",
        )
        parser.add_argument(
            "--vllm-arg",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="--engine vllm: a further vLLM engine argument (AsyncEngineArgs field; VALUE is "
            "JSON where it parses, else a string), e.g. --vllm-arg max_model_len=4096. Repeatable.",
        )

    def handle(self, *args, **options) -> None:
        name: str = options["name"]
        if not name.replace("-", "").replace("_", "").isalnum():
            raise CommandError(f"worker name {name!r} must be letters, digits, '-' or '_'")
        if options["engine"] == ENGINE_SIM:
            self._serve_simulated(name, options)
            return
        model_path = Path(options["model_path"] or settings.MODEL_PATH)
        if not (model_path / "config.json").is_file():
            raise CommandError(
                f"no model at {model_path}: run `python manage.py build_demo_model {model_path}` "
                "or point MODEL_PATH at a checkpoint directory"
            )
        if options["role"] != ROLE_BOTH:
            from workers.vision_encoder import VISION_PARTS

            model_type = json.loads((model_path / "config.json").read_text()).get("model_type")
            if model_type not in VISION_PARTS:
                raise CommandError(
                    f"--role {options['role']} needs a family whose vision tower can be served apart "
                    f"({', '.join(sorted(VISION_PARTS))}); {model_path} is {model_type!r}: use --role both"
                )

        engine_kind: str = options["engine"]
        vllm_args = _vllm_args(options["vllm_arg"]) if engine_kind == ENGINE_VLLM else {}
        if engine_kind == ENGINE_VLLM:
            _check_vllm_options(options["role"], options["device"])

        client = sync_client(settings.REDIS_URL)
        namespace = settings.REDIS_KEY_PREFIX
        instance = new_instance_id()
        registry = WorkerRegistry(client, namespace)
        # The same-name start rule: refuse to run beside a live process of this name; take over
        # from a dead one at once (below, when this process registers). Checked before torch and
        # the model load, so a refused start says so in a second or two, not after ten.
        try:
            predecessor = registry.claim(
                name, instance, watch_s=settings.WORKER_HEARTBEAT_INTERVAL_SECS * 1.5
            )
        except NameInUse as exc:
            raise CommandError(str(exc)) from exc

        from workers.disaggregation import TowerCounter
        from workers.runtime import build_image_loader, install_runtime
        from workers.vision_encoder import vision_tower

        if engine_kind == ENGINE_VLLM:
            _bound_vllm_threads(options["threads"])
        elif options["threads"] > 0:
            import torch

            torch.set_num_threads(options["threads"])

        # Counters go under the deployment's statistics prefix (its database's id), live state not.
        statistics = statistics_namespace()
        metrics = telemetry.attach(client, statistics, name)
        stats = CacheStats(client, statistics, name, recorder=metrics)  # flushed with the metrics
        image_loader = build_image_loader(name, stats, model_path)
        role: str = options["role"]
        index = KvIndex(client, namespace)
        publisher = (
            None
            if options["no_kv_events"] or role == ROLE_ENCODE
            else KvEventPublisher(client, namespace, index=index)
        )
        if publisher is None:
            index.purge_worker(name)  # no `cleared` will come: forget what a previous life held
        encoders = EncoderPool(
            client, namespace, pending_ttl_s=settings.EPD_ENCODE_WAIT_SECS, statistics_namespace=statistics
        )
        features = media_store_from_settings(client, namespace, settings)  # the media side store
        towers = TowerCounter(encoders, name)
        started = time.monotonic()
        if role == ROLE_ENCODE:
            runtime = _encode_runtime(
                name, model_path, options["device"], client, encoders, features, image_loader
            )
            towers.attach(runtime.encoder.vision_module)
            kv_capacity = 0
            warmed = ""
        elif engine_kind == ENGINE_VLLM:
            runtime = _vllm_runtime(
                name, model_path, client, features, image_loader, options["kv_cache_mb"], vllm_args, publisher
            )
            kv_capacity = runtime.engine.kv_capacity_blocks
            warmed = f" (a warm-up prompt took {runtime.engine.warm_up():.0f} ms)"
        else:
            runtime = _generating_runtime(
                name, role, model_path, options["device"], client, encoders, features, image_loader, publisher
            )
            if runtime.engine.vision_loaded:
                towers.attach(vision_tower(runtime.engine.model.model, runtime.engine.model_type))
            else:
                runtime.engine.on_vision_loaded = towers.attach
            kv_capacity = settings.KV_CAPACITY_BLOCKS
            # Before the first heartbeat: no request waits for the first forward pass's setup.
            warmed = f" (a warm-up prompt took {runtime.engine.warm_up():.0f} ms)"
        runtime.instance = instance
        runtime.stats = stats
        model_name = _model_name(options["model_name"], model_path)
        # What routing depends on, published for frontends that cannot read this directory.
        card = read_model_card(model_path)
        publish_card(client, namespace, card)
        if role != ROLE_ENCODE:
            runtime.model_fingerprint = card.fingerprint  # its KV partition, as the frontend's
        _announce_model(model_name, card, name)
        self.stdout.write(
            f"worker {name} ({role}, {engine_kind} engine): loaded {model_path} on {options['device']} "
            f"in {time.monotonic() - started:.1f} s{warmed}"
        )
        install_runtime(runtime)
        if role != ROLE_ENCODE:
            runtime.report_engine_gauges()
        settle_heap()

        heartbeat = Heartbeat(
            name=name,
            model=model_name,
            block_size=settings.KV_BLOCK_SIZE,
            device=options["device"],
            pid=os.getpid(),
            host=socket.gethostname(),
            kv_capacity_blocks=kv_capacity,
            publishes_events=publisher is not None,
            session_scoped=image_loader.session_scoped,
            shared_image_cache=image_loader.shared_cache_description,
            instance=instance,
            role=role,
            schedule_policy="" if role == ROLE_ENCODE else runtime.engine.schedule_policy,
            family=card.family,
            fingerprint=card.fingerprint,
        )
        Worker.objects.update_or_create(
            name=name,
            defaults={
                "role": role,
                "device": heartbeat.device,
                "model_name": model_name,
                "block_size": heartbeat.block_size,
                "host": heartbeat.host,
                "pid": heartbeat.pid,
                "registered_at": timezone.now(),
                "deregistered_at": None,
            },
        )
        # No live process serves this name (the claim above), so whatever load is still
        # reserved under it belongs to a dead predecessor: freed now, not when it expires.
        # Frontends waiting on its requests see the new instance and fail them over at once.
        freed = LoadTracker(client, namespace).free_worker(name)
        if predecessor is not None or freed:
            logger.warning(
                "worker %s: took over from instance %s (%d requests freed)",
                name,
                predecessor.instance if predecessor is not None else "?",
                freed,
            )
        announcer = _BlockAnnouncer(name, index, publisher, getattr(runtime, "engine", None))
        load = LoadTracker(client, namespace)

        def after_beat() -> None:
            announcer.check()
            republish_if_lost(client, namespace, card)
            # Reservations whose frontend stopped renewing them go now, even if no frontend
            # decides anything for a while (decisions sweep too).
            load.sweep()

        beats = _HeartbeatLoop(
            registry, heartbeat, runtime if role != ROLE_ENCODE else None, on_beat=after_beat
        )
        beats.start()
        engine_lost = threading.Event()

        def leave_without_engine(error: Exception) -> None:
            # vLLM's engine core died. Leave the fleet now (no decision picks this worker again,
            # and frontends move its requests on as each fails), stop as on SIGTERM, and exit 1
            # so that a supervisor starts the worker again with a new engine.
            engine_lost.set()
            beats.go_dark()
            registry.remove(name, instance)
            index.purge_worker(name)
            self.stderr.write(f"worker {name}: {error}")
            os.kill(os.getpid(), signal.SIGTERM)

        if engine_kind == ENGINE_VLLM:
            runtime.engine.on_dead = leave_without_engine

        from celery.signals import worker_shutting_down

        from inference_platform.celery import app

        # From the first SIGTERM on, the worker takes nothing new but keeps beating while it
        # finishes what it has, so frontends waiting on it do not take it for dead.
        worker_shutting_down.connect(lambda **_: beats.mark_stopping(), weak=False)

        celery_worker = app.Worker(
            hostname=f"{name}@{heartbeat.host}",
            queues=[worker_queue(name)],
            pool_cls="threads",
            concurrency=options["concurrency"],
            loglevel=settings.LOG_LEVEL,
            without_gossip=True,
            without_mingle=True,
            without_heartbeat=True,
            redirect_stdouts=False,
        )
        self.stdout.write(
            f"worker {name}: serving queue {worker_queue(name)} via {redact_url(settings.CELERY_BROKER_URL)}"
        )
        try:
            celery_worker.start()
        finally:
            beats.stop()
            # Only this instance's heartbeat and row: a successor may already serve this name.
            own = registry.remove(name, instance)
            stats.close()
            metrics.close()
            image_loader.close()
            if engine_kind == ENGINE_VLLM:
                runtime.engine.close()  # vLLM's engine core is a child process: stop it with us
            if own:
                Worker.objects.filter(name=name, pid=heartbeat.pid, host=heartbeat.host).update(
                    deregistered_at=timezone.now()
                )
            self.stdout.write(f"worker {name}: deregistered" if own else f"worker {name}: stopped (replaced)")
        if engine_lost.is_set():
            raise CommandError(f"worker {name} stopped: vLLM's engine core died")

    def _serve_simulated(self, name: str, options: dict[str, Any]) -> None:
        """`--engine sim`: `--count` simulated workers in this process (workers.sim_engine), no
        model and no torch; the real queues, heartbeats, KV events and response streams."""
        from workers.runtime import install_runtime
        from workers.sim_engine.clock import SimClock
        from workers.sim_engine.fleet import SimFleet, fleet_names
        from workers.sim_engine.profile import load_profile

        if options["role"] != ROLE_BOTH:
            raise CommandError("--engine sim runs --role both only")
        if options["count"] < 1 or options["sim_speedup"] <= 0:
            raise CommandError("--count must be >= 1 and --sim-speedup > 0")
        if options["sim_kv_blocks"] is not None and options["sim_kv_blocks"] < 1:
            raise CommandError("--sim-kv-blocks must be >= 1")
        try:
            profile = load_profile(options["sim_profile"])
        except (OSError, ValueError, KeyError) as exc:
            raise CommandError(f"--sim-profile: {exc}") from exc
        if options["sim_kv_blocks"] is not None:
            profile = dataclasses.replace(profile, kv_capacity_blocks=options["sim_kv_blocks"])
        client = sync_client(settings.REDIS_URL)
        namespace = settings.REDIS_KEY_PREFIX
        statistics = statistics_namespace()
        metrics = telemetry.attach(client, statistics, name)
        # No weights are loaded, but where the model directory is a checkpoint, its routing files
        # (a few small files) make the card a real worker of it announces and publishes: a
        # frontend that cannot see the directory routes its requests all the same.
        model_path = Path(options["model_path"] or settings.MODEL_PATH)
        model_name = _model_name(options["model_name"], model_path)
        card = read_model_card(model_path) if (model_path / "config.json").is_file() else None
        if card is not None:
            publish_card(client, namespace, card)
            _announce_model(model_name, card, name)
        clock = SimClock(speedup=options["sim_speedup"]).start()
        fleet = SimFleet(
            fleet_names(name, options["count"]),
            profile=profile,
            clock=clock,
            client=client,
            namespace=namespace,
            model_name=model_name,
            block_size=settings.KV_BLOCK_SIZE,
            heartbeat_ttl_s=settings.WORKER_HEARTBEAT_TTL_SECS,
            heartbeat_interval_s=settings.WORKER_HEARTBEAT_INTERVAL_SECS,
            publish_events=not options["no_kv_events"],
            card=card,
        )
        try:
            fleet.start()
        except NameInUse as exc:
            raise CommandError(str(exc)) from exc
        for queue, runtime in fleet.runtimes.items():
            # each worker counts its KV hits and misses as a real one does (flushed with the metrics)
            runtime.stats = CacheStats(client, statistics, runtime.name, recorder=metrics)
            install_runtime(runtime, queue)
            runtime.report_engine_gauges()  # as a model's worker does: an idle one is on the charts too
        self.stdout.write(
            f"worker {name}: {options['count']} simulated workers (profile {profile.name}, "
            f"speed-up {options['sim_speedup']:g}) serving via {redact_url(settings.CELERY_BROKER_URL)}"
        )
        from celery.signals import worker_shutting_down

        from inference_platform.celery import app

        worker_shutting_down.connect(lambda **_: fleet.mark_stopping(), weak=False)
        celery_worker = app.Worker(
            hostname=f"{name}@{socket.gethostname()}",
            queues=fleet.queues,
            pool_cls="threads",
            concurrency=options["concurrency"],
            loglevel=settings.LOG_LEVEL,
            without_gossip=True,
            without_mingle=True,
            without_heartbeat=True,
            redirect_stdouts=False,
        )
        try:
            celery_worker.start()
        finally:
            fleet.stop()
            clock.stop()
            metrics.close()
            self.stdout.write(f"worker {name}: {options['count']} simulated workers deregistered")


def _announce_model(model_name: str, card, worker: str) -> None:
    """The worker serves `model_name` with this card (routing.models.Model.announce); a name
    recorded with another fingerprint is logged, the operator's to resolve."""
    model = Model.announce(model_name, card.family, card.fingerprint)
    if model.fingerprint != card.fingerprint:
        logger.error(
            "worker %s: model %r is recorded with fingerprint %s, this directory's is %s: it "
            "gets none of the model's requests until an operator resolves it (Models in the admin)",
            worker,
            model_name,
            model.fingerprint,
            card.fingerprint,
        )


def _model_name(given: str | None, model_path: Path) -> str:
    """The name the worker announces: --model-name, else MODEL_NAME for the deployment's own
    model, else the directory's name (a second model needs no setting of its own)."""
    if given:
        return given
    if settings.MODEL_NAME and model_path.resolve() == Path(settings.MODEL_PATH).resolve():
        return settings.MODEL_NAME
    return model_path.resolve().name


class _BlockAnnouncer:
    """Re-announces the worker's cached blocks when the index's epoch changes (Redis lost them).

    Checked with every heartbeat: a Redis restarted without its data comes back with no epoch
    and an empty index, and routing would stay load-only until each worker restarted.
    """

    def __init__(self, name: str, index: KvIndex, publisher: KvEventPublisher | None, engine) -> None:
        self._name = name
        self._index = index
        self._publisher = publisher
        self._engine = engine
        self._epoch = index.epoch()  # the engine announced `cleared` when it loaded: in sync

    def check(self) -> None:
        epoch = self._index.epoch()
        if epoch == self._epoch:
            return
        self._epoch = epoch
        if self._publisher is None:
            return  # approximate mode: the router credits what it routes, nothing to announce
        # A block stored or evicted between the snapshot and the publish is announced by its
        # own event too, in order after this one, so the index converges.
        blocks = tuple(self._engine.kv_block_hashes())
        self._publisher.publish(
            [KvEvent("cleared", self._name, ()), KvEvent("stored", self._name, blocks)]
            if blocks
            else [KvEvent("cleared", self._name, ())]
        )
        logger.warning("worker %s: the KV index was lost; re-announced %d blocks", self._name, len(blocks))


def _encode_runtime(name, model_path, device, client, encoders, features, image_loader):
    """An encode worker: the vision tower and projector only, and an embedding cache whose entries
    are listed in Redis for the frontend's embedding-cache affinity."""
    from workers.disaggregation import EncodeRuntime
    from workers.vision_encoder import VisionEncoder

    encoders.reset_worker(name)  # a new process holds nothing and has nothing in progress
    runtime = EncodeRuntime(
        name=name,
        encoder=VisionEncoder.load(model_path, device=device),
        # The engine's name for the same checkpoint: the features' label must agree with it.
        model_name=model_path.name,
        client=client,
        namespace=settings.REDIS_KEY_PREFIX,
        pool=encoders,
        store=features,
        embedding_cache_bytes=int(settings.EMBEDDING_CACHE_MB * 1024 * 1024),
        image_loader=image_loader,
        session_scoped=image_loader.session_scoped,
    )
    return runtime


def _generating_runtime(name, role, model_path, device, client, encoders, features, image_loader, publisher):
    """A `both` or `llm` worker: the whole model (an `llm` worker drops its vision tower until a
    fallback needs it) and the receipt of encode workers' features."""
    from workers.disaggregation import FeatureReceiver
    from workers.engine import Engine  # torch is imported here, in the worker process only
    from workers.runtime import WorkerRuntime

    engine = Engine.load(
        model_path,
        device=device,
        block_size=settings.KV_BLOCK_SIZE,
        kv_capacity_blocks=settings.KV_CAPACITY_BLOCKS,
        embedding_cache_bytes=int(settings.EMBEDDING_CACHE_MB * 1024 * 1024),
        load_image=image_loader.load_for_engine,
        publish_events=publisher.publish if publisher is not None else None,
        worker_name=name,
        max_batch_tokens=settings.ENGINE_MAX_BATCH_TOKENS,
        max_running=settings.ENGINE_MAX_RUNNING,
        schedule_policy=settings.ENGINE_SCHEDULE_POLICY,
        prefill_join_tokens=settings.ENGINE_PREFILL_JOIN_TOKENS,
    )
    if role == ROLE_LLM:
        engine.unload_vision(model_path)
    return WorkerRuntime(
        name=name,
        engine=engine,
        client=client,
        namespace=settings.REDIS_KEY_PREFIX,
        session_scoped=image_loader.session_scoped,
        image_loader=image_loader,
        media=features,
        features=FeatureReceiver(
            worker=name,
            pool=encoders,
            store=features,
            registry=WorkerRegistry(client, settings.REDIS_KEY_PREFIX),
            model_name=engine.model_name,
            processor_fingerprint=engine.processor_fingerprint,
        ),
    )


def _check_vllm_options(role: str, device: str) -> None:
    """What a vLLM worker cannot do, refused before anything loads."""
    if role != ROLE_BOTH:
        raise CommandError(
            f"--engine vllm runs --role both only: encode/llm disaggregation (--role {role}) "
            "is the native engine's (vLLM's own E/PD is not wired to the platform yet)"
        )
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens, and the router must hash
    # prompts in vLLM's blocks (a mismatch would make every overlap wrong): one setting for both.
    if device == "cpu" and settings.KV_BLOCK_SIZE % 32:
        raise CommandError(
            f"--engine vllm on a CPU needs KV_BLOCK_SIZE a multiple of 32 (vLLM's block), got "
            f"{settings.KV_BLOCK_SIZE}: set KV_BLOCK_SIZE=32 for the whole deployment, router included"
        )


def _vllm_args(pairs: list[str]) -> dict[str, Any]:
    """--vllm-arg NAME=VALUE pairs as vLLM engine arguments (VALUE as JSON where it parses)."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.isidentifier():
            raise CommandError(f"--vllm-arg {pair!r}: expected NAME=VALUE, NAME an engine argument")
        try:
            parsed[name] = json.loads(raw)
        except json.JSONDecodeError:
            parsed[name] = raw
    return parsed


def _bound_vllm_threads(threads: int) -> None:
    """vLLM binds its OpenMP threads to cores on its own ("auto"): two engines on one machine
    then fight over the same cores. Unless the operator bound them (VLLM_CPU_OMP_THREADS_BIND),
    the engine core runs unbound with --threads threads (its child process inherits these).

    Unbound, on the CPU, the model also runs in the engine core's own process (vLLM's UniProc
    executor; VLLM_ENABLE_V1_MULTIPROCESSING=0 only keeps vLLM's CPU platform from forcing its
    multiprocess one, AsyncLLM's engine core stays a process of its own). vLLM's multiprocess
    executor hands each step to a third process through shared memory, each side spinning while
    it waits for the other: beside the platform's processes on few cores those spins took the
    cores the steps needed (bench/vllm_engine.py: the engines' CPU per pass 17-26 s against 14-15 s
    driven directly, and 11-12 s on both sides in one process; 272 -> 378 tok/s through the
    platform). vLLM wants its multiprocess executor to bind threads itself, so an operator's
    binding keeps it."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if not _cuda_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _vllm_runtime(name, model_path, client, features, image_loader, kv_cache_mb, engine_args, publisher):
    """A worker whose engine is vLLM's AsyncLLM, with the platform's image loader and side store."""
    from workers.runtime import WorkerRuntime
    from workers.vllm_engine.engine import VllmEngine

    try:
        engine = VllmEngine(
            model_path,
            block_size=settings.KV_BLOCK_SIZE,
            kv_cache_bytes=kv_cache_mb << 20,
            max_running=settings.ENGINE_MAX_RUNNING,
            load_image=image_loader.load_for_engine,
            model_name=settings.MODEL_NAME or None,
            engine_args=engine_args,
            publish_events=publisher.publish if publisher is not None else None,
            worker_name=name,
        ).start()
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    return WorkerRuntime(
        name=name,
        engine=engine,
        client=client,
        namespace=settings.REDIS_KEY_PREFIX,
        session_scoped=image_loader.session_scoped,
        image_loader=image_loader,
        media=features,
    )


def settle_heap() -> None:
    """Hide what was loaded so far (the model, its tokenizer, torch and transformers: some 400k
    objects that live as long as the process) from the garbage collector.

    Collections then skip them while serving, and the interpreter's collections at exit do not
    walk them: those took seconds on a busy CPU, so `make run`'s Ctrl-C (honcho gives a process
    5 s after SIGTERM) SIGKILLed workers that had already deregistered.
    """
    gc.collect()
    gc.freeze()


class _HeartbeatLoop:
    """Refreshes the worker's heartbeat key every interval, well inside its TTL, with the engine's
    state at that moment (and its gauges)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        heartbeat: Heartbeat,
        runtime=None,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        self._registry = registry
        self._heartbeat = heartbeat
        self._runtime = runtime  # a generating worker's WorkerRuntime; None for an encode worker
        self._on_beat = on_beat  # after each beat (the index epoch check)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._dark = False  # no more beats: the worker has left the fleet
        self._write_lock = threading.RLock()  # the heartbeat's own thread may go dark mid-beat
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def mark_stopping(self) -> None:
        with self._lock:
            self._heartbeat = dataclasses.replace(self._heartbeat, stopping=True)
        self._beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def go_dark(self) -> None:
        """Beat no more, from any thread (the heartbeat's own too): a beat under way when this
        is called writes nothing, so the key its caller removes next stays removed."""
        with self._write_lock:
            self._dark = True
        self._stop.set()

    def _beat(self) -> None:
        with self._lock:
            heartbeat = self._heartbeat = dataclasses.replace(self._heartbeat, beat_at=time.time())
        try:
            if self._runtime is not None:
                heartbeat = _with_engine_load(heartbeat, self._runtime)
            with self._write_lock:
                if self._dark:
                    return
                self._registry.beat(heartbeat, settings.WORKER_HEARTBEAT_TTL_SECS)
            if self._on_beat is not None:
                self._on_beat()
        except Exception:  # a Redis hiccup: the next beat may land before the TTL lapses
            logger.warning("worker %s: heartbeat failed", heartbeat.name, exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(settings.WORKER_HEARTBEAT_INTERVAL_SECS):
            self._beat()


def _with_engine_load(heartbeat: Heartbeat, runtime) -> Heartbeat:
    runtime.report_engine_gauges()
    return heartbeat_with_load(heartbeat, runtime.engine)
