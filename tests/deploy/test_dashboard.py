"""The Grafana dashboard queries only what the sidecar exports, and ships in the kustomize base.

Proves: deploy/dashboards/disagg-sidecar.json is a dashboard Grafana can provision (unique
uid, unique panel ids, panels on the 24-column grid without overlaps, every panel on the
``$datasource`` variable); every panel query and every template variable's ``label_values``
parses as PromQL (promql-parser, the Rust parser's Python binding), names only series the
sidecar's registry really exposes, and uses only labels those series have (plus Prometheus'
``job``/``instance``), through aggregations and binary operators; legends name labels the
query's result keeps; the panels cover what the issue asks for (requests by outcome, stage
quantiles, in flight, errors by stage and code, relayed and KV bytes, engine readiness, the prefix
cache's cached tokens, index size, events and gaps); every
overlay renders it as a ConfigMap labelled for Grafana's dashboard sidecar with the file's
exact text. The checker itself rejects an unknown series, an unknown label and a grouping by a
label that is gone.

Does not prove: that a Grafana server renders the panels as intended (no Grafana here), or
that the quantiles are the ones an operator wants.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pq = pytest.importorskip("promql_parser", reason="pip install promql-parser")
pytest.importorskip("yaml", reason="pip install pyyaml")

from deploy_render import DEPLOY_DIR, OVERLAYS, by_kind_name, render_overlay  # noqa: E402
from promql_check import (  # noqa: E402
    QueryError,
    exported_series,
    labels_of,
    legend_labels,
    parse,
)

DASHBOARD = DEPLOY_DIR / "dashboards" / "disagg-sidecar.json"
CONFIG_MAP = "disagg-sidecar-dashboard"
GRID_COLUMNS = 24
# kubectl apply keeps the whole object in an annotation, and annotations are capped at 256 KiB.
MAX_DASHBOARD_BYTES = 200 * 1024
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_]\w*)\)$")
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_GRAFANA_BUILTINS = frozenset({"__rate_interval", "__interval", "__range"})


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def catalogue() -> dict[str, frozenset[str]]:
    return exported_series()


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def all_targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in query_panels(dashboard) for t in p["targets"]]


def test_catalogue_is_the_real_exposition(catalogue: dict[str, frozenset[str]]) -> None:
    """Guards the checks below: the catalogue holds scraped names, not the source's names."""
    assert catalogue["disagg_requests_total"] == {
        "front_door", "route", "engine", "connector", "outcome"
    }
    assert catalogue["disagg_stage_seconds_bucket"] == {"front_door", "stage", "le"}
    assert catalogue["disagg_engine_ready"] == frozenset()
    assert "disagg_requests" not in catalogue
    assert "disagg_stage_seconds" not in catalogue


def test_dashboard_is_provisionable(dashboard: dict[str, Any]) -> None:
    assert DASHBOARD.stat().st_size <= MAX_DASHBOARD_BYTES
    assert dashboard["uid"] == "disagg-sidecar"
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in query_panels(dashboard):
        assert panel["targets"], f"{panel['title']}: no query"
        for ref in [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]:
            assert ref == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_panels_tile_the_grid_without_overlap(dashboard: dict[str, Any]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["y"] >= 0
        assert pos["x"] + pos["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_every_panel_query_uses_exported_series_and_labels(
    dashboard: dict[str, Any], catalogue: dict[str, frozenset[str]]
) -> None:
    for title, target in all_targets(dashboard):
        result = labels_of(parse(target["expr"]), catalogue)
        missing = legend_labels(target.get("legendFormat", "")) - result
        assert not missing, f"{title}: legend names {missing}, the result has {sorted(result)}"


def test_template_variables_query_exported_labels(
    dashboard: dict[str, Any], catalogue: dict[str, frozenset[str]]
) -> None:
    queries = [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in queries} == {"job", "instance", "front_door"}
    for variable in queries:
        match = _LABEL_VALUES.match(variable["query"]["query"])
        assert match, f"{variable['name']}: not a label_values() query"
        assert variable["definition"] == variable["query"]["query"]
        labels = labels_of(parse(match["selector"]), catalogue)
        assert match["label"] in labels, variable["name"]


def test_every_variable_used_is_defined(dashboard: dict[str, Any]) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    texts = [t["expr"] for _, t in all_targets(dashboard)]
    texts += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {a or b for text in texts for a, b in _VARIABLE.findall(text)}
    assert used - _GRAFANA_BUILTINS <= defined


def test_panels_cover_the_issue(dashboard: dict[str, Any]) -> None:
    """Each asked-for view is a panel grouping the right series by the right labels."""
    groupings: set[tuple[str, frozenset[str]]] = set()
    for _, target in all_targets(dashboard):
        tree = parse(target["expr"])

        def visit(node: Any, by: list[frozenset[str]]) -> None:
            if isinstance(node, pq.AggregateExpr) and node.modifier is not None:
                by = [*by, frozenset(node.modifier.labels)]
            if isinstance(node, pq.VectorSelector):
                groupings.add((node.name, by[0] if by else frozenset()))
                return
            for child in _children(node):
                visit(child, by)

        visit(tree, [])
    wanted = {
        ("disagg_requests_total", frozenset({"outcome"})),
        ("disagg_stage_seconds_bucket", frozenset({"le", "stage"})),
        ("disagg_inflight_requests", frozenset({"instance", "front_door"})),
        ("disagg_errors_total", frozenset({"stage", "code"})),
        ("disagg_relayed_bytes_total", frozenset({"front_door"})),
        ("disagg_kv_bytes_total", frozenset({"direction"})),
        ("disagg_engine_ready", frozenset({"instance"})),
        ("disagg_cached_prompt_tokens_bucket", frozenset({"le"})),
        ("disagg_kv_index_blocks", frozenset({"instance"})),
        ("disagg_kv_events_total", frozenset({"kind"})),
        ("disagg_kv_events_gaps_total", frozenset({"cause"})),
    }
    assert wanted <= groupings, sorted(wanted - groupings)
    quantiles = {
        float(str(t["expr"]).split("(", 2)[1].split(",")[0])
        for _, t in all_targets(dashboard)
        if str(t["expr"]).startswith("histogram_quantile(")
    }
    assert {0.5, 0.99} <= quantiles


def _children(node: Any) -> list[Any]:
    if isinstance(node, pq.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, pq.ParenExpr | pq.UnaryExpr | pq.AggregateExpr):
        return [node.expr]
    if isinstance(node, pq.Call):
        return list(node.args)
    if isinstance(node, pq.BinaryExpr):
        return [node.lhs, node.rhs]
    return []


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        ("rate(disagg_requests[5m])", "not a series the sidecar exports"),
        ('disagg_kv_bytes_total{front_door="grpc"}', "front_door"),
        ("sum by (stage) (disagg_requests_total)", "stage"),
        ("sum by (outcome) (sum by (route) (disagg_requests_total))", "outcome"),
        ("histogram_quantile(0.9, sum by (stage) (rate(disagg_stage_seconds_bucket[5m])))", "le"),
        ("disagg_errors_total / on (outcome) disagg_requests_total", "outcome"),
        ("sum(rate(disagg_requests_total[5m]", "not PromQL"),
    ],
)
def test_checker_rejects_what_the_sidecar_does_not_export(
    expr: str, complaint: str, catalogue: dict[str, frozenset[str]]
) -> None:
    with pytest.raises(QueryError, match=complaint):
        labels_of(parse(expr), catalogue)


def test_checker_follows_labels_through_operators(catalogue: dict[str, frozenset[str]]) -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, stage) "
        '(rate(disagg_stage_seconds_bucket{front_door=~"$front_door"}[$__rate_interval])))'
    )
    assert labels_of(parse(expr), catalogue) == {"stage"}
    assert labels_of(parse("sum without (le) (disagg_stage_seconds_bucket)"), catalogue) == {
        "front_door", "stage", "job", "instance"
    }
    assert labels_of(parse("sum(disagg_inflight_requests) / 2"), catalogue) == frozenset()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_ship_the_dashboard_for_grafanas_sidecar(overlay: str) -> None:
    config_map = by_kind_name(render_overlay(overlay))[("ConfigMap", CONFIG_MAP)]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {DASHBOARD.name: DASHBOARD.read_text(encoding="utf-8")}
