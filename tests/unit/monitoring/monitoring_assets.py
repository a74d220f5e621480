"""The chart's monitoring files as tests read them: rendered objects, the alert and dashboard expressions, the metric
names those expressions use, and the metric names the worker's and operator's registries export."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from tidal.operator.metrics import OperatorMetrics
from tidal.worker.layers.expert_exchange import PHASES, ExchangeSnapshot, ExchangeTotals
from tidal.worker.lifecycle.metrics import LifecycleMetrics
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.testing.engine_stats import idle_engine_stats

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "tidal"
DASHBOARD = CHART / "files" / "monitoring" / "dashboard.json"
ALL_ON = tuple(
    f"monitoring.{part}.enabled=true" for part in ("serviceMonitor", "podMonitor", "prometheusRule", "dashboard")
)


def tool(name: str, env_dir: str) -> str | None:
    """`name` on PATH, else in the directory $env_dir names (hack/env.sh sets both)."""
    found = shutil.which(name)
    if found:
        return found
    candidate = Path(os.environ.get(env_dir, "/nonexistent")) / name
    return str(candidate) if candidate.is_file() else None


def helm_template(helm: str, *sets: str, namespace: str = "tidal-system") -> list[dict[str, Any]]:
    """`sets` are `--set` arguments; a value written `key:=json` goes through `--set-json` (numbers stay numbers)."""
    args = []
    for s in sets:
        key, _, value = s.partition("=")
        args += ["--set-json", f"{key[:-1]}={value}"] if key.endswith(":") else ["--set", s]
    out = subprocess.run(
        [helm, "template", "tidal", str(CHART), "--namespace", namespace, *args],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    return [doc for doc in yaml.safe_load_all(out) if doc]


def dashboard_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def dashboard_from_file() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def rule_expressions(groups: list[dict[str, Any]]) -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


# PromQL words that look like identifiers but name no series.
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"}
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers that are not functions, keywords, label names (in matchers
    and grouping clauses), strings, durations or Grafana variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)  # Grafana variables
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group()
        follows = text[match.end() :].lstrip()[:1]
        if word in _KEYWORDS or follows == "(" or text[max(0, match.start() - 1)].isdigit():
            continue
        names.add(word)
    return names


_TIMED_RANK_EXCHANGES = ExchangeSnapshot(0, tuple(ExchangeTotals(p, 0, 0, 0, 0.0) for p in PHASES))


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}


def exported_metric_names() -> set[str]:
    """Every sample name a worker (serving and lifecycle metrics) and the operator export, including those of
    labelled families that have no child yet (from the family's type: `_total`, `_bucket`/`_sum`/`_count`, `_info`)."""
    worker = CollectorRegistry()
    WorkerMetrics(worker, lambda: idle_engine_stats(_TIMED_RANK_EXCHANGES))  # every family a worker can export
    LifecycleMetrics(worker)
    operator = OperatorMetrics(CollectorRegistry()).registry
    names = set()
    for registry in (worker, operator):
        for family in registry.collect():
            names.update(sample.name for sample in family.samples)
            names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names
