"""The node agent as seen through the API server: pods run, become Ready, restart, stop, get their env."""

import json
import os
import signal
import sys

import httpx
import pytest

from tidal.devcluster.nodeagent.allocators import visible_devices
from tidal.devcluster.nodeagent.faults import request_fault
from tidal.devcluster.testing import is_ready, phase_is, restart_count_at_least

pytestmark = pytest.mark.e2e

POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def pod_manifest(name: str, command: list[str], restart_policy: str = "Always", **container: object) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": 5,
            # The node agent ignores the image; it runs the command as a local process.
            "containers": [{"name": "main", "image": "not-used", "command": command, **container}],
        },
    }


def http_server_pod(name: str, port: int = 8080, **container: object) -> dict:
    probe = {"httpGet": {"path": "/", "port": port}, "periodSeconds": 1}
    return pod_manifest(
        name,
        [sys.executable, "-m", "http.server", "--bind", "$(POD_IP)", str(port)],
        env=[POD_IP_ENV],
        readinessProbe=probe,
        **container,
    )


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_http_server_pod_becomes_ready_serves_and_stops_on_delete(devcluster, namespace):
    devcluster.core.create_namespaced_pod(namespace, http_server_pod("web"))
    pod = devcluster.wait_pod(namespace, "web", is_ready, timeout_s=30, what="Ready")

    pod_ip = pod["status"]["podIP"]
    assert pod_ip.startswith("127.0.") and pod_ip != "127.0.0.1"
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]
    assert httpx.get(f"http://{pod_ip}:8080/", timeout=5).status_code == 200

    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("tidal://"))
    assert process_alive(pid)
    devcluster.core.delete_namespaced_pod("web", namespace)
    devcluster.wait_pod_gone(namespace, "web", timeout_s=20)
    assert not process_alive(pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{pod_ip}:8080/", timeout=2)


def test_two_pods_get_distinct_addresses_and_share_a_port(devcluster, namespace):
    for name in ("a", "b"):
        devcluster.core.create_namespaced_pod(namespace, http_server_pod(name))
    ips = {devcluster.wait_pod(namespace, name, is_ready, timeout_s=30)["status"]["podIP"] for name in ("a", "b")}
    assert len(ips) == 2
    for ip in ips:
        assert httpx.get(f"http://{ip}:8080/", timeout=5).status_code == 200


def test_crashing_container_is_restarted_with_growing_restart_count(devcluster, namespace):
    crash = pod_manifest("crash", [sys.executable, "-c", "print('starting', flush=True); raise SystemExit(3)"])
    devcluster.core.create_namespaced_pod(namespace, crash)
    pod = devcluster.wait_pod(namespace, "crash", restart_count_at_least(2), timeout_s=30, what="2 restarts")

    status = pod["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["lastState"]["terminated"]["reason"] == "Error"
    assert pod["status"]["phase"] == "Running"  # restartPolicy Always: never terminal
    # The run before the current one (the current one may not have printed yet), as `kubectl logs --previous`.
    assert devcluster.pod_log(namespace, "crash", "main", previous=True) == "starting\n"
    # The same file through the API server, which proxies to the node agent's log endpoint.
    assert devcluster.kubectl("logs", "crash", "-n", namespace, "--previous").stdout == "starting\n"


def test_never_restart_policy_ends_in_failed_and_on_failure_success_completes(devcluster, namespace):
    failing = pod_manifest("fails", ["sh", "-c", "exit 7"], restart_policy="Never")
    passing = pod_manifest("passes", ["sh", "-c", "exit 1"], restart_policy="OnFailure")
    # OnFailure: first run fails, the restart (marker file present) succeeds -> Succeeded with one restart.
    passing["spec"]["containers"][0]["command"] = ["sh", "-c", "test -e done && exit 0; touch done; exit 1"]
    devcluster.core.create_namespaced_pod(namespace, failing)
    devcluster.core.create_namespaced_pod(namespace, passing)

    failed = devcluster.wait_pod(namespace, "fails", phase_is("Failed", "Succeeded"), timeout_s=30)
    assert failed["status"]["phase"] == "Failed"
    assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 7
    assert failed["status"]["containerStatuses"][0]["restartCount"] == 0
    done = devcluster.wait_pod(namespace, "passes", phase_is("Failed", "Succeeded"), timeout_s=30)
    assert done["status"]["phase"] == "Succeeded"
    assert done["status"]["containerStatuses"][0]["restartCount"] == 1


def test_failing_liveness_probe_restarts_the_container(devcluster, namespace):
    live = {"httpGet": {"path": "/missing", "port": 8080}, "periodSeconds": 1, "failureThreshold": 2}
    devcluster.core.create_namespaced_pod(namespace, http_server_pod("sick", livenessProbe=live))
    pod = devcluster.wait_pod(namespace, "sick", restart_count_at_least(1), timeout_s=30, what="a liveness restart")
    assert "terminated" in pod["status"]["containerStatuses"][0]["lastState"]
    # What `kubectl describe pod` shows, recorded by the node agent as the kubelet would.
    events = devcluster.core.list_namespaced_event(namespace, field_selector="involvedObject.name=sick").items
    reasons = {e.reason for e in events}
    assert {"Started", "Unhealthy", "Killing"} <= reasons, reasons
    assert any(e.reason == "Unhealthy" and "Liveness probe failed" in e.message for e in events)


def test_frozen_pod_turns_unready_and_recovers_when_thawed(devcluster, namespace):
    devcluster.core.create_namespaced_pod(namespace, http_server_pod("frozen"))
    devcluster.wait_pod(namespace, "frozen", is_ready, timeout_s=30, what="Ready")

    devcluster.inject_fault(namespace, "frozen", "freeze")
    devcluster.wait_pod(namespace, "frozen", lambda p: not is_ready(p), timeout_s=30, what="unready while frozen")
    devcluster.inject_fault(namespace, "frozen", "thaw")
    pod = devcluster.wait_pod(namespace, "frozen", is_ready, timeout_s=30, what="Ready again")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    # The conditions that are True again carry no reason or message left over from while they were False.
    ready = [c for c in pod["status"]["conditions"] if c["type"] in ("Ready", "ContainersReady")]
    assert all(c["status"] == "True" and "reason" not in c and "message" not in c for c in ready), ready


def test_crash_fault_by_annotation_restarts_the_pod_process(devcluster, namespace):
    devcluster.core.create_namespaced_pod(namespace, http_server_pod("victim"))
    before = devcluster.wait_pod(namespace, "victim", is_ready, timeout_s=30, what="Ready")
    request_fault(devcluster.core, namespace, "victim", "crash")
    pod = devcluster.wait_pod(
        namespace,
        "victim",
        lambda p: restart_count_at_least(1)(p) and is_ready(p),
        timeout_s=30,
        what="restarted and Ready",
    )
    last = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 128 + signal.SIGKILL
    assert pod["status"]["podIP"] == before["status"]["podIP"]  # the pod keeps its address across restarts


def test_env_value_from_secret_configmap_and_fields(devcluster, namespace):
    core = devcluster.core
    core.create_namespaced_secret(namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"mode": "fast"}})
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MY_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "COMBINED", "value": "$(MY_NAME)-$(MODE)"},
    ]
    dump = "import json, os; print(json.dumps({k: v for k, v in os.environ.items()}))"
    manifest = pod_manifest(
        "env",
        [sys.executable, "-c", dump],
        restart_policy="Never",
        env=env,
        envFrom=[{"configMapRef": {"name": "settings"}, "prefix": "CM_"}],
        workingDir=str(devcluster.info.state_dir),
    )
    core.create_namespaced_pod(namespace, manifest)
    pod = devcluster.wait_pod(namespace, "env", phase_is("Succeeded", "Failed"), timeout_s=30)
    assert pod["status"]["phase"] == "Succeeded", devcluster.pod_log(namespace, "env", "main")

    seen = json.loads(devcluster.pod_log(namespace, "env", "main"))
    assert seen["TOKEN"] == "s3cret"
    assert seen["MODE"] == "fast" and seen["CM_mode"] == "fast"
    assert seen["MY_NAME"] == "env" and seen["MY_NAMESPACE"] == namespace
    assert seen["MY_IP"] == pod["status"]["podIP"]
    assert seen["COMBINED"] == "env-fast"
    assert seen["KUBECONFIG"].endswith("/kubeconfig")


def test_missing_secret_holds_the_container_until_it_exists(devcluster, namespace):
    env = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "later", "key": "x"}}}]
    devcluster.core.create_namespaced_pod(
        namespace, pod_manifest("waits", ["sh", "-c", 'echo "x=$X"'], restart_policy="Never", env=env)
    )

    def held(pod: dict) -> bool:
        statuses = pod.get("status", {}).get("containerStatuses", [])
        return bool(statuses) and statuses[0]["state"].get("waiting", {}).get("reason") == "CreateContainerConfigError"

    pod = devcluster.wait_pod(namespace, "waits", held, timeout_s=30, what="CreateContainerConfigError")
    assert 'secret "later" not found' in pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    devcluster.core.create_namespaced_secret(namespace, {"metadata": {"name": "later"}, "stringData": {"x": "1"}})
    devcluster.wait_pod(namespace, "waits", phase_is("Succeeded"), timeout_s=30)
    assert devcluster.pod_log(namespace, "waits", "main").strip() == "x=1"


def test_pod_asking_for_more_gpus_than_the_node_has_is_rejected_by_the_node(devcluster, namespace):
    # nodeName set directly bypasses the scheduler, so the node agent's own admission check has to catch it.
    too_many = pod_manifest("greedy", ["sleep", "30"], restart_policy="Never")
    too_many["spec"]["nodeName"] = devcluster.info.node_name
    too_many["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(devcluster.info.gpus + 1)}}
    devcluster.core.create_namespaced_pod(namespace, too_many)
    pod = devcluster.wait_pod(namespace, "greedy", phase_is("Failed"), timeout_s=30)
    assert pod["status"]["reason"] == "UnexpectedAdmissionError"
    assert "nvidia.com/gpu" in pod["status"]["message"]


def test_gpu_pods_get_distinct_devices_and_others_none(devcluster, namespace):
    show = [sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"]
    for name in ("gpu-a", "gpu-b", "cpu"):
        manifest = pod_manifest(name, show, restart_policy="Never")
        if name != "cpu":
            manifest["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        devcluster.core.create_namespaced_pod(namespace, manifest)
    seen = {}
    for name in ("gpu-a", "gpu-b", "cpu"):
        devcluster.wait_pod(namespace, name, phase_is("Succeeded"), timeout_s=30)
        seen[name] = devcluster.pod_log(namespace, name, "main").strip()
    assert seen["cpu"] == "''"
    # The node agent inherited this process's environment; its CUDA_VISIBLE_DEVICES (if any) maps the indices.
    agent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert {seen["gpu-a"], seen["gpu-b"]} == {repr(visible_devices([i], agent_visible)) for i in (0, 1)}


def test_init_containers_run_in_order_before_the_main_container(devcluster, namespace):
    # Containers of one pod share its scratch working directory, so the init container can hand over a file.
    ok = pod_manifest("init-ok", ["cat", "handoff"], restart_policy="Never")
    ok["spec"]["initContainers"] = [
        {"name": "first", "image": "not-used", "command": ["sh", "-c", "echo one > handoff"]},
        {"name": "second", "image": "not-used", "command": ["sh", "-c", "echo two >> handoff"]},
    ]
    bad = pod_manifest("init-bad", ["sh", "-c", "echo main ran"], restart_policy="Never")
    bad["spec"]["initContainers"] = [{"name": "fails", "image": "not-used", "command": ["sh", "-c", "exit 4"]}]
    devcluster.core.create_namespaced_pod(namespace, ok)
    devcluster.core.create_namespaced_pod(namespace, bad)

    done = devcluster.wait_pod(namespace, "init-ok", phase_is("Succeeded", "Failed"), timeout_s=30)
    assert done["status"]["phase"] == "Succeeded"
    assert devcluster.pod_log(namespace, "init-ok", "main") == "one\ntwo\n"
    assert [s["state"]["terminated"]["exitCode"] for s in done["status"]["initContainerStatuses"]] == [0, 0]

    failed = devcluster.wait_pod(namespace, "init-bad", phase_is("Succeeded", "Failed"), timeout_s=30)
    assert failed["status"]["phase"] == "Failed"
    assert failed["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 4
    assert "running" not in failed["status"]["containerStatuses"][0]["state"]
    assert devcluster.pod_log(namespace, "init-bad", "main") == ""
