import pytest

from tidal.operator.config import OperatorConfig, OperatorConfigError


def test_from_env_parses_lists_and_labels():
    config = OperatorConfig.from_env(
        {
            "TIDAL_OPERATOR_NAMESPACE": "tidal-system",
            "TIDAL_OPERATOR_POD_LABELS": "app.kubernetes.io/name=tidal-operator, app.kubernetes.io/instance=tidal",
            "TIDAL_OPERATOR_WATCH_NAMESPACES": "ml, research,",
            "TIDAL_OPERATOR_METRICS_PORT": "9090",
            "UNRELATED": "x",
        }
    )
    assert config.watch_namespaces == ["ml", "research"] and config.metrics_port == 9090
    assert config.identity().pod_labels == {
        "app.kubernetes.io/name": "tidal-operator",
        "app.kubernetes.io/instance": "tidal",
    }


def test_bad_environment_names_the_variable():
    with pytest.raises(OperatorConfigError) as err:
        OperatorConfig.from_env({"TIDAL_OPERATOR_POD_LABELS": "oops", "TIDAL_OPERATOR_HEALTH_PORT": "0"})
    text = str(err.value)
    assert "TIDAL_OPERATOR_NAMESPACE" in text and "TIDAL_OPERATOR_POD_LABELS" in text
    assert "TIDAL_OPERATOR_HEALTH_PORT" in text


def test_main_help_documents_the_environment_and_other_arguments_are_refused(capsys):
    from tidal.operator.__main__ import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m tidal.operator")
    assert "TIDAL_OPERATOR_NAMESPACE" in out and "TIDAL_OPERATOR_LEASE_SECONDS" in out
    assert main(["--namespace"]) == 2
    assert "takes no arguments" in capsys.readouterr().err
