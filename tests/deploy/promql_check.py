"""Checks a PromQL query against the series the sidecar exports (for the dashboard test).

    Metrics() --one child per family--> exposition text --parser--> {series name: label names}
    query --promql_parser.parse--> AST --labels_of--> the labels the query's result carries,
                                                      each selector/matcher/grouping checked

The catalogue comes from the sidecar's own registry through its real exposition, so a
histogram's ``_bucket``/``_sum``/``_count`` and a counter's ``_total`` are what Prometheus
would scrape, not names guessed from the source. ``labels_of`` follows labels through the
operators the dashboard uses (aggregations, calls, binary operators, parentheses), and every
``by``/``without``/``on``/``ignoring`` label must exist in the operand it groups.

Deliberate limits: label-creating functions (``label_replace``, ``label_join``) and
subqueries are refused rather than modelled; Grafana's own variables must be substituted
before parsing (``grafana_to_promql``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import promql_parser as pq
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from sidecar.observability.metrics import Metrics

# Prometheus attaches these to every scraped series (the scrape job and the target address).
TARGET_LABELS = frozenset({"job", "instance"})

# Grafana's interval variables are only legal where PromQL wants a duration.
_GRAFANA_DURATIONS = ("$__rate_interval", "$__interval", "$__range")
_LABEL_MAKERS = frozenset({"label_replace", "label_join"})
# Functions whose result drops a label of their vector argument.
_DROPS = {"histogram_quantile": frozenset({"le"})}


# Series name -> the label names it is exposed with.
Catalogue = dict[str, frozenset[str]]


class QueryError(Exception):
    """A query names a series the sidecar does not export, or a label that series lacks."""


def exported_series() -> Catalogue:
    """Every series name a fresh sidecar registry exposes, with its label names."""
    metrics = Metrics()
    for family in vars(metrics).values():
        if isinstance(family, MetricWrapperBase):
            # prometheus_client has no public accessor for a family's label names, and a
            # labelled family exposes nothing until it has a child.
            names = family._labelnames
            if names:
                family.labels(*("x" for _ in names))
    out: Catalogue = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, frozenset()) | frozenset(sample.labels)
    return out


def grafana_to_promql(expr: str) -> str:
    """``expr`` with Grafana's interval variables replaced by a fixed duration."""
    for variable in _GRAFANA_DURATIONS:
        expr = expr.replace(variable, "5m")
    return expr


def parse(expr: str) -> pq.Expr:
    try:
        return pq.parse(grafana_to_promql(expr))
    except ValueError as exc:
        raise QueryError(f"not PromQL: {expr!r}: {exc}") from exc


def labels_of(node: pq.Expr, catalogue: Catalogue) -> frozenset[str]:
    """The label names of ``node``'s result; raises QueryError on any unknown series or label."""
    if isinstance(node, pq.VectorSelector):
        return _selector_labels(node, catalogue)
    if isinstance(node, pq.MatrixSelector):
        return _selector_labels(node.vector_selector, catalogue)
    if isinstance(node, pq.ParenExpr | pq.UnaryExpr):
        return labels_of(node.expr, catalogue)
    if isinstance(node, pq.NumberLiteral | pq.StringLiteral):
        return frozenset()
    if isinstance(node, pq.Call):
        return _call_labels(node, catalogue)
    if isinstance(node, pq.AggregateExpr):
        return _aggregate_labels(node, catalogue)
    if isinstance(node, pq.BinaryExpr):
        return _binary_labels(node, catalogue)
    raise QueryError(f"unsupported expression {type(node).__name__}: {node}")


def _selector_labels(node: pq.VectorSelector, catalogue: Catalogue) -> frozenset[str]:
    if node.name not in catalogue:
        raise QueryError(f"{node.name!r} is not a series the sidecar exports")
    labels = catalogue[node.name] | TARGET_LABELS
    _require(labels, (m.name for m in node.matchers.matchers if m.name != "__name__"), node)
    return labels


def _call_labels(node: pq.Call, catalogue: Catalogue) -> frozenset[str]:
    name = node.func.name
    if name in _LABEL_MAKERS:
        raise QueryError(f"{name} is not modelled by this check")
    vectors = [labels_of(arg, catalogue) for arg in node.args]
    labels = frozenset().union(*vectors) if vectors else frozenset()
    if name == "histogram_quantile" and "le" not in labels:
        raise QueryError(f"histogram_quantile over a vector without 'le': {node}")
    return labels - _DROPS.get(name, frozenset())


def _aggregate_labels(node: pq.AggregateExpr, catalogue: Catalogue) -> frozenset[str]:
    inner = labels_of(node.expr, catalogue)
    modifier = node.modifier
    if modifier is None:
        return frozenset()
    _require(inner, modifier.labels, node)
    if modifier.type == pq.AggModifierType.By:
        return frozenset(modifier.labels)
    return inner - frozenset(modifier.labels)


def _binary_labels(node: pq.BinaryExpr, catalogue: Catalogue) -> frozenset[str]:
    lhs, rhs = labels_of(node.lhs, catalogue), labels_of(node.rhs, catalogue)
    modifier = node.modifier
    matching = modifier.matching if modifier is not None else None
    if matching is not None:
        _require(lhs, matching.labels, node)
        _require(rhs, matching.labels, node)
    if modifier is not None and modifier.card == pq.VectorMatchCardinality.OneToMany:
        return rhs
    # One-to-one and many-to-one results carry the left side's labels; a scalar side adds none.
    return lhs or rhs


def _require(available: frozenset[str], wanted: Iterable[str], node: pq.Expr) -> None:
    missing = sorted(set(wanted) - available)
    if missing:
        raise QueryError(f"labels {missing} do not exist in {node} (it has {sorted(available)})")


def legend_labels(legend: str) -> set[str]:
    """The label names a Grafana legend format like ``{{stage}} p99`` refers to."""
    return {m.strip() for m in re.findall(r"\{\{\s*([^}]+?)\s*\}\}", legend)}
