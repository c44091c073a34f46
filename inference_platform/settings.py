"""Django settings, read from the environment (see README.md for every variable)."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

from inference_platform.env import env_bool, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent

# Models load from local directories only: never from a hub, in any process of the platform.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SECRET_KEY = env_str("DJANGO_SECRET_KEY") or "dev-only-insecure-key-change-me-in-production"
DEBUG = env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "channels",
    "inference_platform",
    "routing",
    "workers",
    "tenants",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # The admin's CSS and JS, served by the ASGI app itself (no separate web server needed), by
    # WhiteNoise made async-capable so that API requests stay on the event loop.
    "inference_platform.static_files.StaticFilesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "inference_platform.urls"
ASGI_APPLICATION = "inference_platform.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "tenants.context_processors.api_auth",
                "inference_platform.fleet_status.fleet_banner",
            ],
        },
    },
]

_database_url = env_str("DATABASE_URL")
if not _database_url:
    (BASE_DIR / "var").mkdir(exist_ok=True)
DATABASES = {
    "default": dj_database_url.parse(
        _database_url or f"sqlite:///{BASE_DIR / 'var' / 'db.sqlite3'}",
        conn_max_age=60,
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes (web, workers) share the file: wait for locks instead of failing, and
    # take the write lock at BEGIN so two workers registering at once queue instead of
    # one failing with "database is locked" on its lock upgrade.
    DATABASES["default"].setdefault("OPTIONS", {}).update(timeout=20, transaction_mode="IMMEDIATE")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
WHITENOISE_USE_FINDERS = True  # straight from the apps' static folders: no collectstatic step

# --- Redis, Celery -----------------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL") or "redis://127.0.0.1:6379/0"
REDIS_KEY_PREFIX = env_str("REDIS_KEY_PREFIX") or "mmr:"

# The longest any one Redis operation may take (the broker's included): a frozen Redis answers
# a request with a 503 within it. Timeouts are never retried; a dropped connection is, once.
REDIS_TIMEOUT_SECS = env_float("REDIS_TIMEOUT_SECS", 5.0, positive=True)

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL") or REDIS_URL
# Every broker key (queues, bindings) lives under the deployment's prefix, like our own keys.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "global_keyprefix": REDIS_KEY_PREFIX,
    "socket_timeout": REDIS_TIMEOUT_SECS,
    "socket_connect_timeout": min(REDIS_TIMEOUT_SECS, 2.0),
}
# A publish that fails is retried once, at once, within the same bounded wait.
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 1, "interval_start": 0, "interval_step": 0}
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True  # answers travel back through the request's Redis stream
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Each worker consumes its own queue only; nothing is routed to a shared default queue.
CELERY_TASK_DEFAULT_QUEUE = "unrouted"

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": f"{REDIS_KEY_PREFIX}asgi"},
    }
}

# --- Model and workers -------------------------------------------------------------------------
MODEL_PATH = Path(env_str("MODEL_PATH") or BASE_DIR / "var" / "models" / "demo")
if not MODEL_PATH.is_absolute():
    MODEL_PATH = BASE_DIR / MODEL_PATH
MODEL_NAME = env_str("MODEL_NAME") or ""  # empty: the model directory's name
# Where a frontend writes the routing files (model cards) workers published in Redis, one folder
# per fingerprint, and how many models' routing views it keeps loaded at once.
MODEL_CARD_DIR = Path(env_str("MODEL_CARD_DIR") or BASE_DIR / "var" / "model-cards")
MODEL_VIEWS_LOADED = env_int("MODEL_VIEWS_LOADED", 8, minimum=1)
KV_BLOCK_SIZE = env_int("KV_BLOCK_SIZE", 16, minimum=1)
WORKER_HEARTBEAT_TTL_SECS = env_float("WORKER_HEARTBEAT_TTL_SECS", 6.0, positive=True)
WORKER_HEARTBEAT_INTERVAL_SECS = env_float("WORKER_HEARTBEAT_INTERVAL_SECS", 2.0, positive=True)
# A frontend reads the fleet (every worker's heartbeat) at most this often, not per request
# (inference_platform.serving.dispatch.FleetRead): a quarter of the interval heartbeats come at.
FLEET_VIEW_MAX_AGE_SECS = env_float(
    "FLEET_VIEW_MAX_AGE_SECS", WORKER_HEARTBEAT_INTERVAL_SECS / 4, positive=True
)
# The worker's engine batches requests: each step is one forward pass over up to
# ENGINE_MAX_BATCH_TOKENS tokens (decodes plus prompt chunks) of at most ENGINE_MAX_RUNNING requests.
ENGINE_MAX_RUNNING = env_int("ENGINE_MAX_RUNNING", 16, minimum=1)
ENGINE_MAX_BATCH_TOKENS = env_int("ENGINE_MAX_BATCH_TOKENS", 512, minimum=1)
# Which prompts a step computes first (workers.scheduler): shortest_first puts a cache hit's short
# tail before a cold prompt's images and chunks; fcfs is arrival order (the baseline).
ENGINE_SCHEDULE_POLICY = (env_str("ENGINE_SCHEDULE_POLICY") or "shortest_first").lower()
if ENGINE_SCHEDULE_POLICY not in ("shortest_first", "fcfs"):
    raise ValueError(f"ENGINE_SCHEDULE_POLICY={ENGINE_SCHEDULE_POLICY!r} must be shortest_first or fcfs")
# shortest_first: a prompt with at most this many tokens left may share a step with another
# prompt; a longer one gets a step of its own. Sized for a CPU; a GPU wants a few hundred.
ENGINE_PREFILL_JOIN_TOKENS = env_int("ENGINE_PREFILL_JOIN_TOKENS", 64, minimum=0)
# Celery threads per worker: enough for a full batch plus a small waiting queue in the engine.
ENGINE_WAITING_SLOTS = env_int("ENGINE_WAITING_SLOTS", 4, minimum=0)
WORKER_CONCURRENCY = env_int("WORKER_CONCURRENCY", ENGINE_MAX_RUNNING + ENGINE_WAITING_SLOTS, minimum=1)
KV_CAPACITY_BLOCKS = env_int("KV_CAPACITY_BLOCKS", 4096, minimum=1)  # per worker, in blocks of KV_BLOCK_SIZE
EMBEDDING_CACHE_MB = env_float("EMBEDDING_CACHE_MB", 256.0, minimum=0.0)
IMAGE_LOCAL_CACHE_ENTRIES = env_int("IMAGE_LOCAL_CACHE_ENTRIES", 8, minimum=0)  # decoded images per worker
# E/PD (encode workers): how long an LLM worker waits for an image's features before it encodes the
# image itself (they travel through the media side store, MEDIA_STORE_*).
EPD_ENCODE_WAIT_SECS = env_float("EPD_ENCODE_WAIT_SECS", 30.0, positive=True)
# E/PD split (routing.fleet.encoders.split_images): an image stays on the LLM worker (aggregated path)
# when the encoder's backlog would make it wait longer than the LLM worker would take to encode it,
# its own backlog included, at EPD_LOCAL_ENCODE_WEIGHT times the encoder's measured milliseconds
# per image (above 1: the LLM worker also prefills every request, and its encoding stalls its
# batch, text included). 1.5 measured best of 1.25/1.5/2 in bench/encoder_disagg.py for both
# streams, once the LLM worker encodes its share while the encoder's features travel; at 2 the
# encoder was the bottleneck under concurrent image requests. EPD_SPLIT=0: every uncovered image
# goes to the encoder. EPD_ENCODE_MS_DEFAULT stands in until an encoder measured one.
EPD_SPLIT = env_bool("EPD_SPLIT", True)
EPD_LOCAL_ENCODE_WEIGHT = env_float("EPD_LOCAL_ENCODE_WEIGHT", 1.5, positive=True)
EPD_ENCODE_MS_DEFAULT = env_float("EPD_ENCODE_MS_DEFAULT", 200.0, positive=True)
# How long the API waits for a worker's first token, then between tokens, before a 504.
REQUEST_FIRST_TOKEN_TIMEOUT_SECS = env_float("REQUEST_FIRST_TOKEN_TIMEOUT_SECS", 120.0, positive=True)
REQUEST_TOKEN_TIMEOUT_SECS = env_float("REQUEST_TOKEN_TIMEOUT_SECS", 60.0, positive=True)
MAX_TOKENS_LIMIT = env_int("MAX_TOKENS_LIMIT", 4096, minimum=1)
# A request whose worker dies before its first token goes to another worker, at most this often.
REQUEST_MIGRATION_LIMIT = env_int("REQUEST_MIGRATION_LIMIT", 2, minimum=0)
# A frontend refreshes a mark on each request it follows; a worker drops a request whose mark is
# older than this (its frontend died) and frees its load at once.
REQUEST_LIVENESS_TTL_SECS = env_float("REQUEST_LIVENESS_TTL_SECS", 10.0, positive=True)

# --- API keys and tenants ----------------------------------------------------------------------
# Every /v1/* call needs a tenant's key. Off only for a local demo: the admin and the start-up
# banner then say so loudly, and every caller shares one anonymous, unlimited tenant.
API_AUTH_REQUIRED = env_bool("API_AUTH_REQUIRED", True)
# Prometheus may scrape /metrics with this bearer token instead of a staff key (empty: staff keys only).
METRICS_TOKEN = env_str("METRICS_TOKEN") or ""
# How often the admin dashboard asks for new figures while it shows an hour or less (longer
# windows ask every 30 s, or every minute past six hours, or this if it is longer).
DASHBOARD_POLL_INTERVAL_SECS = env_float("DASHBOARD_POLL_INTERVAL_SECS", 5.0, positive=True)
# How long a frontend keeps a key it verified while nothing says a key or tenant changed (any
# change anywhere is seen at the next request through Redis; tenants.keys). 0: ask the database
# on every request.
API_KEY_CACHE_SECS = env_float("API_KEY_CACHE_SECS", 30.0, minimum=0.0)
# A concurrency slot a crashed frontend never freed expires after the first-token timeout plus
# this long (a request streaming for longer than that stops counting against the limit).
TENANT_SLOT_TTL_SECS = env_float("TENANT_SLOT_TTL_SECS", 600.0, positive=True)

# --- Routing (Dynamo's formula; defaults measured by bench/workload.py) ---------------------------
ROUTER_MODE = (env_str("ROUTER_MODE") or "kv").lower()  # kv | round_robin | random (baselines)
if ROUTER_MODE not in ("kv", "round_robin", "random"):
    raise ValueError(f"ROUTER_MODE={ROUTER_MODE!r} must be kv, round_robin or random")
ROUTER_OVERLAP_CREDIT = env_float("ROUTER_OVERLAP_CREDIT", 1.0, minimum=0.0)
# Prefill weighs 32x a decode block: TTFT is queued prefill (see routing.kv.selection.RoutingPolicy).
ROUTER_PREFILL_LOAD_SCALE = env_float("ROUTER_PREFILL_LOAD_SCALE", 32.0, minimum=0.0)
ROUTER_TEMPERATURE = env_float("ROUTER_TEMPERATURE", 0.0, minimum=0.0)
ROUTER_SESSION_AFFINITY = env_bool("ROUTER_SESSION_AFFINITY", True)
ROUTER_AFFINITY_TTL_SECS = env_float("ROUTER_AFFINITY_TTL_SECS", 1800.0, positive=True)
ROUTER_APPROXIMATE_TTL_SECS = env_float("ROUTER_APPROXIMATE_TTL_SECS", 120.0, positive=True)
ROUTER_LOAD_ENTRY_TTL_SECS = env_float("ROUTER_LOAD_ENTRY_TTL_SECS", 300.0, positive=True)
# Predicted blocks: a routed prompt counts as cached on its worker for this long, until the
# worker's own events arrive (Dynamo's --router-predicted-ttl-secs). 0 turns it off.
ROUTER_PREDICTED_TTL_SECS = env_float("ROUTER_PREDICTED_TTL_SECS", 3.0, minimum=0.0)
# Each frontend keeps a copy of the KV index in memory, fed by the index's event stream
# (routing.kv.replica), and finds a large fleet's candidates there instead of in Redis: Redis's
# one thread then does per decision what must be shared (load, reservation, predicted blocks).
# Off: every decision reads the index in Redis. Costs ~200 bytes of memory per cached block.
ROUTER_INDEX_REPLICA = env_bool("ROUTER_INDEX_REPLICA", True)
# Session affinity as a bounded preference (see routing.kv.selection.RoutingPolicy).
ROUTER_AFFINITY_COST_SLACK = env_float("ROUTER_AFFINITY_COST_SLACK", 0.25, minimum=0.0)
ROUTER_AFFINITY_MAX_OVERLAP_LEAD_BLOCKS = env_int("ROUTER_AFFINITY_MAX_OVERLAP_LEAD_BLOCKS", 2, minimum=0)
# Bounded loads: a worker this many requests in flight ahead of the least loaded one, and this
# many times its load, is passed over when another would serve the request within its queue's
# wait (routing.kv.selection.RoutingPolicy).
ROUTER_LOAD_BOUND_GAP = env_int("ROUTER_LOAD_BOUND_GAP", 2, minimum=0)  # 0: off
ROUTER_LOAD_BOUND_RATIO = env_float("ROUTER_LOAD_BOUND_RATIO", 1.5, minimum=1.0)
# Reserved prefill drains at each worker's measured prefill rate (its heartbeat carries it), so
# a prompt half done weighs half; off: a prompt counts in full until its first token (Dynamo's).
ROUTER_PREFILL_DRAIN = env_bool("ROUTER_PREFILL_DRAIN", True)
# Busy thresholds: a worker at or past one takes no new request; when all are, the request waits
# in the admission queue (503 + Retry-After with the queue off). By default a worker is busy when
# its engine holds as many requests as it accepts (a full batch and its waiting slots): past
# that, a request would only wait first come first served in the worker's Celery queue, where
# neither fairness nor priority can reach it.
ROUTER_BUSY_MAX_REQUESTS = env_int(
    "ROUTER_BUSY_MAX_REQUESTS", ENGINE_MAX_RUNNING + ENGINE_WAITING_SLOTS, minimum=0
)  # running + waiting; 0: off
ROUTER_BUSY_KV_FRACTION = env_float("ROUTER_BUSY_KV_FRACTION", 0.0, minimum=0.0)  # of capacity; 0: off
# At least a heartbeat interval: the engine's report may count a finished request that long.
ROUTER_BUSY_RETRY_AFTER_SECS = env_float("ROUTER_BUSY_RETRY_AFTER_SECS", 2.0, positive=True)
# The admission queue (routing.admission): when no worker of the model can take a request now,
# it waits in an order shared by every frontend (priority bands, then fair between tenants by
# weight, then arrival) for at most ROUTER_QUEUE_MAX_WAIT_SECS. Off: today's 503 at once.
ROUTER_QUEUE_ENABLED = env_bool("ROUTER_QUEUE_ENABLED", True)
ROUTER_QUEUE_MAX_WAIT_SECS = env_float("ROUTER_QUEUE_MAX_WAIT_SECS", 30.0, positive=True)
ROUTER_QUEUE_MAX_DEPTH = env_int("ROUTER_QUEUE_MAX_DEPTH", 2048, minimum=1)  # every tenant's, together
ROUTER_QUEUE_MAX_TENANT_DEPTH = env_int("ROUTER_QUEUE_MAX_TENANT_DEPTH", 512, minimum=1)
# Ordering within a band: "fair" (start-time fair queuing by tenant weight) or "fifo" (arrival
# order, the fairness baseline).
ROUTER_QUEUE_ORDER = (env_str("ROUTER_QUEUE_ORDER") or "fair").lower()
if ROUTER_QUEUE_ORDER not in ("fair", "fifo"):
    raise ValueError(f"ROUTER_QUEUE_ORDER={ROUTER_QUEUE_ORDER!r} must be fair or fifo")
# Requests' priorities (their tenant's default, or the lower one they ask for) order the queue's
# bands and the engines' waiting prompts; off, every request runs at its tenant's default.
REQUEST_PRIORITIES = env_bool("REQUEST_PRIORITIES", True)
# A frontend's queued requests stay while its liveness mark does (renewed by every waiting
# request's poll, at most a second apart): a frontend killed mid-wait leaves none behind past it.
ROUTER_QUEUE_FRONTEND_TTL_SECS = env_float("ROUTER_QUEUE_FRONTEND_TTL_SECS", 5.0, minimum=2.0)
# How many requests a frontend process works on at once between arrival and dispatch (limits,
# preparation, the decision or joining the queue); the others wait in the queue's own order
# (inference_platform.serving.arrivals), so a flood cannot put its work ahead of other tenants'.
FRONTEND_ARRIVAL_CONCURRENCY = env_int("FRONTEND_ARRIVAL_CONCURRENCY", 4, minimum=1)

# --- Media (names and defaults from Dynamo's documentation) ------------------------------------
DYN_MM_FRONTEND_DECODING = env_bool("DYN_MM_FRONTEND_DECODING", False)
# The seed's "Python chat processor" path: the frontend runs the model's own transformers
# processor to find each image's tokens (any family transformers supports) and hands the
# processed inputs to the worker. Off: the layout registry, with no torch in the web process.
DYN_CHAT_PROCESSOR = (env_str("DYN_CHAT_PROCESSOR") or "").lower()
if DYN_CHAT_PROCESSOR not in ("", "transformers"):
    raise ValueError(f"DYN_CHAT_PROCESSOR={DYN_CHAT_PROCESSOR!r} must be empty or 'transformers'")
DYN_MM_MAX_FILE_SIZE_MB = env_float("DYN_MM_MAX_FILE_SIZE_MB", 64.0, positive=True)
DYN_MM_SHARED_IMAGE_CACHE_ENABLED = env_bool("DYN_MM_SHARED_IMAGE_CACHE_ENABLED", False)
DYN_MM_SHARED_IMAGE_CACHE_URL = env_str("DYN_MM_SHARED_IMAGE_CACHE_URL")
DYN_MM_SHARED_IMAGE_CACHE_TTL_SECS = env_int("DYN_MM_SHARED_IMAGE_CACHE_TTL_SECS", 3600, minimum=1)
DYN_MM_SHARED_IMAGE_CACHE_CONNECT_TIMEOUT_SECS = env_float(
    "DYN_MM_SHARED_IMAGE_CACHE_CONNECT_TIMEOUT_SECS", 0.1, positive=True
)
DYN_MM_SHARED_IMAGE_CACHE_IO_TIMEOUT_SECS = env_float(
    "DYN_MM_SHARED_IMAGE_CACHE_IO_TIMEOUT_SECS", 2.0, positive=True
)
# Dynamo's key prefix; deployments sharing one cache service may separate themselves with another.
SHARED_IMAGE_CACHE_KEY_PREFIX = env_str("SHARED_IMAGE_CACHE_KEY_PREFIX") or "dynamo:mm:image:"
DYN_MM_IMAGE_CACHE_SESSION_SCOPED = env_bool("DYN_MM_IMAGE_CACHE_SESSION_SCOPED", False)
MEDIA_ALLOWED_HOSTS = env_list("MEDIA_ALLOWED_HOSTS", [])  # SSRF allowlist: hosts or CIDRs
MEDIA_MAX_PIXELS = env_int("MEDIA_MAX_PIXELS", 89_478_485, minimum=1)  # Pillow's bomb limit
MEDIA_CONNECT_TIMEOUT_SECS = env_float("MEDIA_CONNECT_TIMEOUT_SECS", 5.0, positive=True)
MEDIA_READ_TIMEOUT_SECS = env_float("MEDIA_READ_TIMEOUT_SECS", 20.0, positive=True)
# One deadline per image fetch: connect, headers and body together (a slow drip is cut off).
MEDIA_FETCH_DEADLINE_SECS = env_float("MEDIA_FETCH_DEADLINE_SECS", 30.0, positive=True)
# How long a frontend keeps an image's size read by URL, so a repeat question about a picture is
# routed without a round trip to its origin (s; 0 asks the origin every time). The origin's
# Cache-Control max-age shortens it; no-store, no-cache and private keep nothing. Per caller
# partition and, with DYN_MM_IMAGE_CACHE_SESSION_SCOPED, per session (routing.media.images.ImageSizes).
MEDIA_SIZE_CACHE_SECS = env_float("MEDIA_SIZE_CACHE_SECS", 60.0, minimum=0.0)
MEDIA_SIZE_CACHE_ENTRIES = env_int("MEDIA_SIZE_CACHE_ENTRIES", 4096, minimum=1)
# The pictures a frontend decoded from data URLs lately, kept so that one sent again (a chat
# client sends a conversation's pictures with every turn) is not base64-decoded again, nor its
# pixels read again with DYN_MM_FRONTEND_DECODING: at most this many MB per frontend process (0
# keeps none). Per caller partition, as the sizes above (routing.media.images.DecodedDataUrls).
MEDIA_DATA_URL_CACHE_MB = env_float("MEDIA_DATA_URL_CACHE_MB", 64.0, minimum=0.0)
# The media side store (routing/media/store.py): image bytes travel to workers through Redis by
# reference, never inside the Celery message. Caps per request and in total; entries expire.
MEDIA_STORE_TTL_SECS = env_float("MEDIA_STORE_TTL_SECS", 600.0, positive=True)
MEDIA_STORE_MAX_REQUEST_BYTES = int(
    env_float("MEDIA_STORE_MAX_REQUEST_MB", 256.0, positive=True) * 1024 * 1024
)
MEDIA_STORE_MAX_TOTAL_BYTES = int(env_float("MEDIA_STORE_MAX_TOTAL_MB", 2048.0, positive=True) * 1024 * 1024)
# The largest `/v1/*` request body, refused with a 413 while it is read. By default one image of
# DYN_MM_MAX_FILE_SIZE_MB fits as a base64 data URL (4/3 of its size) with 1 MiB of JSON around it.
API_MAX_BODY_BYTES = int(
    env_float("API_MAX_BODY_MB", DYN_MM_MAX_FILE_SIZE_MB * 4 / 3 + 1, positive=True) * 1024 * 1024
)
# Django's own check on `request.body` must not fire first (it would be a 500).
DATA_UPLOAD_MAX_MEMORY_SIZE = API_MAX_BODY_BYTES

# Video parts are always decoded in the frontend (PyAV); each limit refused names its setting.
VIDEO_MAX_DURATION_SECS = env_float("VIDEO_MAX_DURATION_SECS", 600.0, positive=True)
VIDEO_MAX_FRAMES = env_int("VIDEO_MAX_FRAMES", 36_000, minimum=1)  # frames in the clip
VIDEO_MAX_PIXELS_PER_FRAME = env_int("VIDEO_MAX_PIXELS_PER_FRAME", 3840 * 2160, minimum=1)
# Pixels of the sampled frames, decoded and as resized for the model (memory, transfer, encoder work).
VIDEO_MAX_TOTAL_PIXELS = env_int("VIDEO_MAX_TOTAL_PIXELS", 256 * 1024 * 1024, minimum=1)
VIDEO_DECODE_DEADLINE_SECS = env_float("VIDEO_DECODE_DEADLINE_SECS", 30.0, positive=True)
# Recent decodes kept by the clip's content hash, per frontend process: a repeated video decodes once.
VIDEO_DECODE_CACHE_MB = env_float("VIDEO_DECODE_CACHE_MB", 256.0, minimum=0.0)

# --- Logging -----------------------------------------------------------------------------------
# LOG_LEVELS="routing=debug,workers=info" raises or lowers single loggers, as Dynamo's DYN_LOG.
LOG_LEVEL = (env_str("LOG_LEVEL") or "INFO").upper()
_logger_levels = {}
for _item in env_list("LOG_LEVELS", []):
    _name, _, _level = _item.partition("=")
    if not _level:
        _name, _level = "root", _name
    _logger_levels[_name.strip()] = {"level": _level.strip().upper()}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(processName)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": _logger_levels.pop("root", {}).get("level", LOG_LEVEL)},
    "loggers": {
        "django.server": {"level": "WARNING"},
        **_logger_levels,
    },
}

REST_FRAMEWORK = {
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
}
