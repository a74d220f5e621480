"""Planner: the scale subresource's status fields (status.replicas, status.selector) that `kubectl scale`, the
HorizontalPodAutoscaler and KEDA read."""

from operator_fixtures import healthy, make_model, pod_for, run, with_status

from tidal.operator.builders.pod import build_pod

SELECTOR = "tidal.dev/model=tiny,tidal.dev/rank=0"


def _matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selector semantics, as the HPA applies the status field."""
    wanted = dict(term.split("=", 1) for term in selector.split(","))
    return all(labels.get(key) == value for key, value in wanted.items())


def test_steady_state_counts_replicas_and_names_the_selector():
    model = make_model({"replicas": 2})
    pods, ranks = healthy(model)
    first = run(model, pods, ranks)
    assert (first.status.replicas, first.status.selector) == (2, SELECTOR)
    # Both fields survive the round trip through the API, so a steady model writes no status.
    assert run(with_status(model, first), pods, ranks, minutes=5).actions == []


def test_scale_up_counts_a_replica_once_its_pod_exists():
    model = make_model({"replicas": 3})
    pods, ranks = healthy(make_model({"replicas": 2}))
    assert run(model, pods, ranks).status.replicas == 2
    pending = pod_for(model, 2, phase="Pending", ready=False)
    assert run(model, [*pods, pending], ranks).status.replicas == 3


def test_scale_down_counts_a_removed_replica_until_its_pod_terminates():
    model = make_model({"replicas": 1})
    pods, ranks = healthy(make_model({"replicas": 2}))
    assert run(model, pods, ranks).status.replicas == 2
    going = pod_for(model, 1, terminating=True, ready=False)
    assert run(model, [pods[0], going], ranks).status.replicas == 1


def test_pods_that_ended_for_good_do_not_count():
    model = make_model({"replicas": 2})
    pods, ranks = healthy(model)
    pods[1] = pod_for(model, 1, phase="Failed", ready=False)
    assert run(model, pods, ranks).status.replicas == 1


def test_expert_parallel_counts_groups_not_ranks():
    model = make_model({"replicas": 2, "expertParallel": 4})
    pods, ranks = healthy(model)
    assert len(pods) == 8
    assert run(model, pods, ranks).status.replicas == 2
    # A group that lost ranks (rank 0 included) is still a replica while any of its ranks runs.
    survivors = [p for p in pods if not (p.replica == 1 and p.rank in (0, 1))]
    assert run(model, survivors, ranks).status.replicas == 2


def test_scaled_to_zero_keeps_the_selector():
    result = run(make_model({"replicas": 0}), [], {})
    assert (result.status.replicas, result.status.selector) == (0, SELECTOR)


def test_selector_matches_rank_zero_of_each_replica_only():
    model = make_model({"replicas": 2, "expertParallel": 3})
    selector = run(model, [], {}).status.selector
    assert selector is not None
    chosen = {
        (replica, rank)
        for replica in range(2)
        for rank in range(3)
        if _matches(selector, build_pod(model, replica, rank)["metadata"]["labels"])
    }
    # One pod per replica: the HPA takes the number of ready selected pods as the current replica count.
    assert chosen == {(0, 0), (1, 0)}
    other = make_model({"replicas": 1}, name="tiny2")
    assert not _matches(selector, build_pod(other, 0, 0)["metadata"]["labels"])
