"""Every metric the platform records, declared once: name, kind, labels, help and buckets.

`routing.observe.telemetry` refuses a name that is not declared here, `/metrics` writes HELP and TYPE
from here, and a test checks the README documents each one. Naming conventions are in
docs/ARCHITECTURE.md ("Metrics"): names here carry neither the `mmr_` prefix nor a counter's
`_total` (the exposition adds both); seconds and bytes are the units, named as a suffix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "histogram", "gauge"]

# Request latencies: 5 ms to 2 min (a slow first token on a loaded CPU worker is seconds).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# Steps inside a request (a routing decision, one image decode, the gap between tokens).
FAST_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


CATALOG: dict[str, Metric] = {}


def declare(metric: Metric) -> Metric:
    if metric.name in CATALOG:
        raise ValueError(f"metric {metric.name!r} is declared twice")
    if metric.name.endswith("_total"):
        raise ValueError(f"declare counter {metric.name!r} without _total: the exposition adds it")
    if metric.kind == "histogram" and not metric.buckets:
        raise ValueError(f"histogram {metric.name!r} needs buckets")
    CATALOG[metric.name] = metric
    return metric


# --- The frontend: one request's life as the client sees it -------------------------------
REQUESTS = declare(
    Metric(
        "requests",
        "counter",
        'Chat requests answered, by HTTP status, the worker that served them and its model ("none": no '
        "worker chosen, or no model known).",
        ("status", "worker", "model"),
    )
)
# Every answer of the API's edge, whatever refused it (a missing or wrong key, a wrong content
# type, a body too large), which `requests` alone would not show for other endpoints: vLLM's
# server exposes the same as `http_requests_total{handler,status}`. `handler` is the route's
# pattern ("unmatched" for a path no route serves), so it stays a short list.
HTTP_REQUESTS = declare(
    Metric(
        "http_requests",
        "counter",
        "HTTP responses of /v1/* and /metrics, by route pattern and HTTP status (401, 415 and 413 included).",
        ("handler", "status"),
    )
)
PROMPT_TOKENS = declare(
    Metric(
        "prompt_tokens",
        "counter",
        "Prompt tokens of answered requests, image tokens included.",
        ("worker", "model"),
    )
)
CACHED_PROMPT_TOKENS = declare(
    Metric(
        "cached_prompt_tokens",
        "counter",
        "Prompt tokens of answered requests that the worker's prefix KV cache already held.",
        ("worker", "model"),
    )
)
COMPLETION_TOKENS = declare(
    Metric("completion_tokens", "counter", "Tokens generated for answered requests.", ("worker", "model"))
)
TTFT = declare(
    Metric(
        "ttft_seconds",
        "histogram",
        "Time to first token: from the request's arrival at the frontend to its first generated token.",
        ("worker", "model"),
        LATENCY_BUCKETS,
    )
)
REQUEST_DURATION = declare(
    Metric(
        "request_duration_seconds",
        "histogram",
        "End-to-end latency: from the request's arrival at the frontend to its last byte.",
        ("worker", "model"),
        LATENCY_BUCKETS,
    )
)
# The admission queue (routing.admission): what waits for a worker (each frontend process counts
# its own waiting requests; the processes' gauges add up to the queue), how long requests
# waited, and those it turned away.
QUEUE_DEPTH = declare(
    Metric(
        "admission_queue_depth",
        "gauge",
        "Requests waiting in the admission queue for a worker, by model, tenant (id) and priority.",
        ("model", "tenant", "priority"),
    )
)
QUEUE_WAIT = declare(
    Metric(
        "admission_queue_wait_seconds",
        "histogram",
        "Time a request waited in the admission queue for a worker (dispatched, shed or abandoned).",
        ("model", "priority"),
        LATENCY_BUCKETS,
    )
)
REQUESTS_SHED = declare(
    Metric(
        "requests_shed",
        "counter",
        "Requests turned away for want of a worker, by cause: all_workers_busy (queue off),"
        " queue_full, tenant_queue_full, queue_timeout, queue_lost.",
        ("cause",),
    )
)
ROUTING_DECISION = declare(
    Metric(
        "routing_decision_seconds",
        "histogram",
        "Time the frontend spent choosing a worker (eligibility, overlaps, load, affinity).",
        (),
        FAST_BUCKETS,
    )
)
ROUTING_DECISIONS = declare(
    Metric(
        "routing_decisions",
        "counter",
        "Routing decisions by the worker chosen and why it was chosen.",
        ("worker", "reason"),
    )
)
REQUEST_MIGRATIONS = declare(
    Metric(
        "request_migrations",
        "counter",
        "Requests moved to another worker because theirs died before the first token, by new worker.",
        ("worker",),
    )
)
REQUEST_REPLANS = declare(
    Metric(
        "request_replans",
        "counter",
        "Requests planned again because a picture changed at its origin after its size was read, by worker.",
        ("worker",),
    )
)
# The routing quality figure (issue 10 computes it: the best eligible worker's overlap minus
# the chosen worker's, in KV blocks). Record both per routed request, so the dashboard and
# Grafana can show the share given up (given_up / best); they already chart these two names.
ROUTING_OVERLAP_GIVEN_UP = declare(
    Metric(
        "routing_overlap_given_up_blocks",
        "counter",
        "Prefix KV blocks the router gave up: the best eligible worker's overlap minus the chosen one's.",
        ("worker",),
    )
)
ROUTING_BEST_OVERLAP = declare(
    Metric(
        "routing_best_overlap_blocks",
        "counter",
        "Prefix KV blocks the best eligible worker held for routed requests (what was given up is out of).",
        ("worker",),
    )
)

# --- The worker: what happens between dispatch and the last token -------------------------
QUEUE_TIME = declare(
    Metric(
        "queue_seconds",
        "histogram",
        "Time from the frontend's dispatch to the worker starting the request (clocks of both hosts).",
        ("worker",),
        LATENCY_BUCKETS,
    )
)
ENGINE_TTFT = declare(
    Metric(
        "engine_ttft_seconds",
        "histogram",
        "Time from the worker's engine taking a request to its first token, on the engine's clock"
        " (a simulated worker's is simulated time): TTFT without the frontend and the queue.",
        ("worker",),
        LATENCY_BUCKETS,
    )
)
INTER_TOKEN = declare(
    Metric(
        "inter_token_seconds",
        "histogram",
        "Time between consecutive generated tokens of a request.",
        ("worker",),
        FAST_BUCKETS,
    )
)
IMAGE_FETCH = declare(
    Metric(
        "image_fetch_seconds",
        "histogram",
        "Time a worker spent fetching one image's bytes (shared cache or origin), cache hits excluded.",
        ("worker", "source"),
        (*FAST_BUCKETS, 5.0, 10.0),
    )
)
IMAGE_DECODE = declare(
    Metric(
        "image_decode_seconds",
        "histogram",
        "Time a worker spent decoding one image's bytes into pixels.",
        ("worker",),
        FAST_BUCKETS,
    )
)

# --- Gauges the worker reports about its engine (last value; gone when the process is) ----
ENGINE_RUNNING = declare(
    Metric("engine_running_requests", "gauge", "Requests the worker's engine is generating now.", ("worker",))
)
ENGINE_WAITING = declare(
    Metric(
        "engine_waiting_requests",
        "gauge",
        "Requests the worker accepted that wait for the engine.",
        ("worker",),
    )
)
ENGINE_KV_BLOCKS_USED = declare(
    Metric("engine_kv_blocks_used", "gauge", "KV blocks the worker's prefix cache holds now.", ("worker",))
)
EMBEDDING_CACHE_ENTRIES = declare(
    Metric(
        "embedding_cache_entries",
        "gauge",
        "Image embeddings the worker's own embedding cache holds (a `both` or `llm` worker's; an "
        "encode worker's are mmr_encoder_cached_embeddings).",
        ("worker",),
    )
)
ENGINE_KV_BLOCKS_FREE = declare(
    Metric(
        "engine_kv_blocks_free", "gauge", "KV blocks the worker's prefix cache can still take.", ("worker",)
    )
)
