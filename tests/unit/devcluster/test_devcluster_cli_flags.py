"""The devcluster's two command lines take flags generated from their configs; bad values exit 2 naming the flag."""

import argparse

import pytest

from tidal.devcluster import cli as cluster_cli
from tidal.devcluster.config import CLUSTER_OPTIONS, ClusterConfig
from tidal.devcluster.layout import StateLayout
from tidal.devcluster.nodeagent import cli as agent_cli
from tidal.devcluster.nodeagent.config import AGENT_OPTIONS
from tidal.devcluster.plan import node_agent


def parse(options, argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    return vars(parser.parse_args(argv))


def test_up_keeps_its_short_spellings_and_offers_every_setting(tmp_path):
    cfg = CLUSTER_OPTIONS.build(
        parse(CLUSTER_OPTIONS, ["--dir", str(tmp_path), "--timeout", "5", "--gpus", "2", "--max-pods", "9"])
    )
    assert (cfg.state_dir, cfg.startup_timeout_s, cfg.gpus, cfg.max_pods) == (tmp_path, 5.0, 2, 9)
    assert CLUSTER_OPTIONS.options["state_dir"].flags == ("--dir", "--state-dir")
    # `up` returns once the cluster is ready, so a cluster that died with it would be gone at once.
    assert "die_with_parent" not in CLUSTER_OPTIONS.options


def test_up_with_bad_values_exits_2_naming_the_flags(capsys):
    with pytest.raises(SystemExit) as exited:
        cluster_cli.main(["up", "--gpus", "99", "--node-name", "Not_A_Name"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "tidal-devcluster up: invalid configuration" in err
    assert "--gpus: Input should be less than or equal to 64 (got '99')" in err
    assert "--node-name: String should match pattern" in err


def test_the_agent_command_line_the_cluster_plans_parses_into_the_agents_config(tmp_path):
    cfg = ClusterConfig(state_dir=tmp_path, node_name="n1", gpus=3, cpu="4", memory="8Gi", max_pods=20)
    argv = node_agent(cfg, StateLayout(tmp_path), pod_subnet=7).argv
    assert argv[3] == "run"
    agent = AGENT_OPTIONS.build(parse(AGENT_OPTIONS, argv[4:]))
    assert (agent.node_name, agent.gpus, agent.cpu, agent.memory, agent.max_pods) == ("n1", 3, "4", "8Gi", 20)
    assert agent.pod_subnet == 7
    assert agent.client_ca is not None and agent.serving_cert is not None and agent.serving_key is not None


def test_agent_run_without_its_required_flags_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        agent_cli.main(["run", "--gpus", "x"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--kubeconfig: Field required" in err and "--state-dir: Field required" in err
    assert "--gpus: Input should be a valid integer" in err
