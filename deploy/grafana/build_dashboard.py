"""Writes deploy/grafana/mmr-dashboard.json, the Grafana dashboard over the platform's metrics.

The JSON is committed (import it in Grafana: Dashboards > New > Import); edit this script and
run `python deploy/grafana/build_dashboard.py` to change it, so the panels stay reviewable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


# The dashboard's `model` variable: a series labelled by worker is kept for the workers of the
# chosen models, joined on mmr_worker_info (1 per worker, labelled with the model it serves).
OF_MODEL = ' * on (worker) group_left() max by (worker) (mmr_worker_info{model=~"$model"})'
MODEL_VARIABLE = {
    "name": "model",
    "label": "Model",
    "type": "query",
    "datasource": DATASOURCE,
    "query": {"query": "label_values(mmr_worker_info, model)", "refId": "models"},
    "definition": "label_values(mmr_worker_info, model)",
    "refresh": 2,
    "includeAll": True,
    "multi": True,
    "allValue": ".*",
    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
}


def hit_rate(cache: str) -> str:
    if cache == "kv":
        return (
            f"sum by (worker) (rate(mmr_kv_cached_tokens_total[{RATE}]){OF_MODEL})"
            f" / sum by (worker) (rate(mmr_kv_prompt_tokens_total[{RATE}]){OF_MODEL})"
        )
    hits = f'sum by (worker) (rate(mmr_cache_hits_total{{cache="{cache}"}}[{RATE}]){OF_MODEL})'
    misses = f'sum by (worker) (rate(mmr_cache_misses_total{{cache="{cache}"}}[{RATE}]){OF_MODEL})'
    return f"{hits} / ({hits} + {misses})"


def quantile(q: float, metric: str, by: str = "", *, per_worker: bool = False) -> str:
    """The q-quantile of a histogram; `per_worker`: one labelled by worker, kept to the chosen models."""
    group = f"le, {by}" if by else "le"
    of_model = OF_MODEL if per_worker else ""
    return f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}]){of_model}))"


# (title, unit, [(expr, legend)], width)
PANELS: list[tuple[str, str, list[tuple[str, str]], int]] = [
    ("Prefix hit rate (KV) per worker (prompt tokens)", "percentunit", [(hit_rate("kv"), "{{worker}}")], 12),
    # Consulted only for images the prefix cache did not cover: 0 lookups is no fault.
    (
        "Embedding cache hit rate per worker (of prefix misses)",
        "percentunit",
        [(hit_rate("embedding"), "{{worker}}")],
        12,
    ),
    ("Local image cache hit rate per worker", "percentunit", [(hit_rate("local_image"), "{{worker}}")], 12),
    ("Shared image cache hit rate per worker", "percentunit", [(hit_rate("shared_image"), "{{worker}}")], 12),
    (
        "Time to first token",
        "s",
        [
            (quantile(0.5, "mmr_ttft_seconds", per_worker=True), "p50"),
            (quantile(0.9, "mmr_ttft_seconds", per_worker=True), "p90"),
            (quantile(0.99, "mmr_ttft_seconds", per_worker=True), "p99"),
        ],
        12,
    ),
    (
        "End-to-end latency and queue time",
        "s",
        [
            (quantile(0.5, "mmr_request_duration_seconds", per_worker=True), "latency p50"),
            (quantile(0.99, "mmr_request_duration_seconds", per_worker=True), "latency p99"),
            (quantile(0.99, "mmr_queue_seconds"), "queue p99"),
            (quantile(0.5, "mmr_inter_token_seconds"), "inter-token p50"),
        ],
        12,
    ),
    (
        "Requests per second by status",
        "reqps",
        [(f"sum by (status) (rate(mmr_requests_total[{RATE}]))", "{{status}}")],
        12,
    ),
    (
        "Tokens per second",
        "short",
        [
            (f"sum(rate(mmr_prompt_tokens_total[{RATE}]))", "prompt"),
            (f"sum(rate(mmr_cached_prompt_tokens_total[{RATE}]))", "prompt, cached"),
            (f"sum(rate(mmr_completion_tokens_total[{RATE}]))", "completion"),
        ],
        12,
    ),
    (
        "Responses other than 200: server (5xx), client (4xx), rate limited (429)",
        "reqps",
        [
            (f'sum(rate(mmr_requests_total{{status=~"5.."}}[{RATE}]))', "5xx server"),
            (f'sum(rate(mmr_requests_total{{status=~"4..",status!="429"}}[{RATE}]))', "4xx client"),
            (f'sum(rate(mmr_requests_total{{status="429"}}[{RATE}]))', "429 rate limited"),
        ],
        12,
    ),
    (
        "Refused at the API's edge, by route (401 key, 403 operator only, 413 too large, 415 not JSON)",
        "reqps",
        [
            (
                "sum by (handler, status)"
                f' (rate(mmr_http_requests_total{{status=~"401|403|413|415"}}[{RATE}]))',
                "{{handler}} {{status}}",
            )
        ],
        12,
    ),
    (
        "Requests running and waiting per worker",
        "short",
        [
            ("sum by (worker) (mmr_engine_running_requests)", "{{worker}} running"),
            ("sum by (worker) (mmr_engine_waiting_requests)", "{{worker}} waiting"),
        ],
        12,
    ),
    (
        "KV cache use per worker",
        "percentunit",
        [
            (
                "sum by (worker) (mmr_engine_kv_blocks_used) / (sum by (worker) (mmr_engine_kv_blocks_used)"
                " + sum by (worker) (mmr_engine_kv_blocks_free))",
                "{{worker}}",
            )
        ],
        12,
    ),
    (
        "Routing: overlap given up (share of the best eligible worker's overlap)",
        "percentunit",
        [
            (
                f"sum(rate(mmr_routing_overlap_given_up_blocks_total[{RATE}]))"
                f" / sum(rate(mmr_routing_best_overlap_blocks_total[{RATE}]))",
                "given up",
            )
        ],
        12,
    ),
    (
        "Routing decisions by reason, and their time",
        "short",
        [
            (f"sum by (reason) (rate(mmr_routing_decisions_total[{RATE}]))", "{{reason}} /s"),
            (quantile(0.99, "mmr_routing_decision_seconds"), "decision p99 (s)"),
        ],
        12,
    ),
    (
        "Image fetch and decode (p99)",
        "s",
        [
            (quantile(0.99, "mmr_image_fetch_seconds", "source"), "fetch from {{source}}"),
            (quantile(0.99, "mmr_image_decode_seconds"), "decode"),
        ],
        12,
    ),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]], width: int) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": width, "x": (index % 2) * 12, "y": (index // 2) * 8},
        "fieldConfig": {
            "defaults": {"unit": unit, "min": 0, "custom": {"spanNulls": False}},
            "overrides": [],
        },
        "options": {"tooltip": {"mode": "multi"}, "legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DATASOURCE}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "title": "Multimodal KV-routing platform",
        "uid": "mmr-platform",
        "tags": ["mmr", "inference"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [MODEL_VARIABLE]},
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


if __name__ == "__main__":
    path = Path(__file__).with_name("mmr-dashboard.json")
    path.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {path}")
