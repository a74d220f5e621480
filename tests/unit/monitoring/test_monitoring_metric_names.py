"""Every series name the chart's alerts and Grafana dashboard query is one the worker or the operator exports."""

import pytest
from monitoring_assets import (
    dashboard_from_file,
    dashboard_targets,
    exported_metric_names,
    helm_template,
    metric_names,
    rule_expressions,
    tool,
)


def test_the_promql_name_parser_skips_functions_labels_and_keywords():
    expr = (
        'histogram_quantile(0.9, sum by (model, le) (rate(tidal_x_bucket{namespace=~"$namespace", le!="1e3"}'
        "[$__rate_interval]))) > 60 or count by (tidal_group_health) (tidal_y offset 5m) == bool 1e-3 and on(a) tidal_z"
    )
    assert metric_names(expr) == {"tidal_x_bucket", "tidal_y", "tidal_z"}


def test_the_exported_names_include_histogram_counter_and_info_suffixes():
    names = exported_metric_names()
    assert {"tidal_time_to_first_token_seconds_bucket", "tidal_requests_total", "tidal_weights_version_info"} <= names
    # A labelled counter with no child yet still counts.
    assert "tidal_operator_worker_call_errors_total" in names
    assert "process_start_time_seconds" in names


def test_dashboard_queries_only_exported_metrics():
    exported = exported_metric_names()
    targets = dashboard_targets(dashboard_from_file())
    assert targets
    for title, expr in targets:
        used = metric_names(expr)
        assert used, f"{title}: no metric in {expr!r}"
        assert used <= exported, f"{title}: {sorted(used - exported)} not exported"


def test_dashboard_variables_query_exported_metrics():
    exported = exported_metric_names()
    for var in dashboard_from_file()["templating"]["list"]:
        if var["type"] == "query":
            # label_values(<series selector>, <label>)
            selector = var["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0]
            used = metric_names(selector)
            assert used and used <= exported, var["name"]


@pytest.fixture(scope="module")
def alert_groups() -> list[dict]:
    helm = tool("helm", "TIDAL_BIN")
    if helm is None:
        pytest.skip("helm not built (hack/build-binaries.sh); CI has it")
    docs = helm_template(helm, "monitoring.prometheusRule.enabled=true")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def test_alerts_query_only_exported_metrics(alert_groups):
    exported = exported_metric_names()
    exprs = rule_expressions(alert_groups)
    assert len(exprs) >= 5
    for alert, expr in exprs.items():
        used = metric_names(expr)
        assert used and used <= exported, f"{alert}: {sorted(used - exported)} not exported"
