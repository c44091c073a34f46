"""deploy/: the Grafana dashboard and the Prometheus scrape config name only what /metrics has,
and the README documents every metric /metrics exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.test_metrics import deployment, scrape  # noqa: F401  (the fixture is used by name)

REPO = Path(__file__).resolve().parent.parent
GRAFANA = REPO / "deploy" / "grafana" / "mmr-dashboard.json"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
METRIC_NAME = re.compile(r"\bmmr_[a-zA-Z0-9_]+")
SAMPLE_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def exposed_families() -> dict[str, str]:
    """/metrics' families by name (a counter's without _total), with their type."""
    _, families = scrape()
    return {name: family.type for name, family in families.items()}


def family_of(sample_name: str, families: dict[str, str]) -> str | None:
    if sample_name in families:
        return sample_name
    for suffix in SAMPLE_SUFFIXES:
        if sample_name.endswith(suffix) and sample_name[: -len(suffix)] in families:
            return sample_name[: -len(suffix)]
    return None


def grafana_exprs() -> list[str]:
    board = json.loads(GRAFANA.read_text())
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


@pytest.mark.django_db
def test_every_metric_the_grafana_dashboard_names_exists_in_metrics(deployment: float) -> None:  # noqa: F811
    families = exposed_families()
    named = {name for expr in grafana_exprs() for name in METRIC_NAME.findall(expr)}
    assert len(named) >= 15
    missing = sorted(name for name in named if family_of(name, families) is None)
    assert missing == []
    # a counter is always read through rate(); a histogram through its buckets
    for expr in grafana_exprs():
        for name in METRIC_NAME.findall(expr):
            kind = families[family_of(name, families)]
            if kind == "counter":
                assert f"rate({name}" in expr, f"{name} read without rate() in {expr}"
            if kind == "histogram":
                assert name.endswith("_bucket"), f"{name} in {expr}"


def test_the_grafana_dashboard_has_the_panels_operators_asked_for() -> None:
    titles = " | ".join(panel["title"] for panel in json.loads(GRAFANA.read_text())["panels"]).lower()
    for wanted in (
        "prefix hit rate (kv) per worker",
        "embedding cache hit rate per worker (of prefix misses)",
        "local image cache hit rate per worker",
        "shared image cache hit rate per worker",
        "time to first token",
        "requests per second",
        "tokens per second",
        "server (5xx), client (4xx), rate limited (429)",
        "refused at the api's edge",
        "running and waiting",
        "kv cache use",
        "overlap given up",
    ):
        assert wanted in titles, wanted
    exprs = " ".join(grafana_exprs())
    assert "histogram_quantile(0.5, sum by (le) (rate(mmr_ttft_seconds_bucket" in exprs
    assert "histogram_quantile(0.99, sum by (le) (rate(mmr_ttft_seconds_bucket" in exprs


def test_the_grafana_json_is_what_its_builder_writes() -> None:
    from deploy.grafana.build_dashboard import dashboard

    assert json.loads(GRAFANA.read_text()) == json.loads(json.dumps(dashboard()))


@pytest.mark.django_db
def test_the_prometheus_scrape_config_scrapes_metrics_with_a_bearer_token(deployment: float) -> None:  # noqa: F811
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    assert job["static_configs"][0]["targets"]
    families = exposed_families()
    named = METRIC_NAME.findall(PROMETHEUS.read_text())
    assert [name for name in named if family_of(name, families) is None] == []


@pytest.mark.django_db
def test_the_readme_documents_every_metric(deployment: float) -> None:  # noqa: F811
    readme = (REPO / "README.md").read_text()
    for name, kind in exposed_families().items():
        shown = f"{name}_total" if kind == "counter" else name
        assert re.search(rf"^\| `{shown}` \| {kind} \|", readme, re.M), f"README has no row for {shown}"
