"""The chart's alerts and dashboard queries through the real promtool (built by hack/install-monitoring.sh):
the rendered PrometheusRule passes `promtool check rules` and the cases of alerts.promtool.yaml pass
`promtool test rules`; the dashboard's queries parse as PromQL."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from monitoring_assets import dashboard_from_file, dashboard_targets, helm_template, tool

HERE = Path(__file__).resolve().parent
HELM = tool("helm", "TIDAL_BIN")
PROMTOOL = tool("promtool", "TIDAL_PROMETHEUS_BIN")
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not built (hack/build-binaries.sh); CI has it")

# What Grafana puts in place of the dashboard's variables.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": ".+", "$model": ".+"}


@pytest.fixture(scope="module")
def promtool() -> str:
    if PROMTOOL is None:
        pytest.fail("promtool is missing: run `make monitoring-tools` (hack/install-monitoring.sh)", pytrace=False)
    return PROMTOOL


def _promtool(promtool: str, *args: str, cwd: Path) -> str:
    result = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _write_rules(path: Path, *sets: str) -> list[dict]:
    assert HELM is not None
    docs = helm_template(HELM, "monitoring.prometheusRule.enabled=true", *sets)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    path.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    return rule["spec"]["groups"]


def test_alerts_pass_promtool_check_and_unit_tests(promtool, tmp_path):
    _write_rules(tmp_path / "alerts.yaml")
    shutil.copy(HERE / "alerts.promtool.yaml", tmp_path)
    checked = _promtool(promtool, "check", "rules", "alerts.yaml", cwd=tmp_path)
    assert "SUCCESS: 6 rules found" in checked
    tested = _promtool(promtool, "test", "rules", "alerts.promtool.yaml", cwd=tmp_path)
    assert "SUCCESS" in tested


def test_thresholds_come_from_values(promtool, tmp_path):
    groups = _write_rules(
        tmp_path / "alerts.yaml",
        "monitoring.prometheusRule.kvCacheUsageRatio:=0.8",
        "monitoring.prometheusRule.degradedFor=3m",
        "monitoring.prometheusRule.severity=critical",
    )
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    assert rules["TidalKVCacheNearlyFull"]["expr"].endswith("> 0.8")
    degraded = rules["TidalModelDegraded"]
    assert degraded["for"] == "3m" and "for 3m;" in degraded["annotations"]["description"]
    assert {r["labels"]["severity"] for r in rules.values()} == {"critical"}
    _promtool(promtool, "check", "rules", "alerts.yaml", cwd=tmp_path)


def test_dashboard_queries_parse_as_promql(promtool, tmp_path):
    # promtool has no query checker of its own; as recording rules the queries go through Prometheus's parser.
    rules = []
    for i, (_, expr) in enumerate(dashboard_targets(dashboard_from_file())):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"SUCCESS: {len(rules)} rules found" in _promtool(promtool, "check", "rules", "dashboard.yaml", cwd=tmp_path)
