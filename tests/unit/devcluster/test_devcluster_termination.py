"""Termination messages on the node agent: each container's own file stands in for its terminationMessagePath, its
text becomes state.terminated.message, and FallbackToLogsOnError takes the log's tail, within the kubelet's limits."""

import sys
import threading
import time
from pathlib import Path

from tidal.devcluster.nodeagent.container import ContainerSlot
from tidal.devcluster.nodeagent.envresolve import EnvContext
from tidal.devcluster.nodeagent.launch import plan_launch
from tidal.devcluster.nodeagent.lifecycle import ContainerRecord
from tidal.devcluster.nodeagent.termination import (
    MAX_FILE_BYTES,
    MAX_LOG_BYTES,
    MAX_LOG_LINES,
    log_tail,
    termination_message,
)

POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"}, "spec": {}}
FALLBACK = {"terminationMessagePolicy": "FallbackToLogsOnError"}
# Writes its first argument to the file its environment names (as the worker does), or prints it without one.
LAST_WORDS = (
    "import os, sys\n"
    "path = os.environ.get('LAST_WORDS')\n"
    "print('loading...', flush=True)\n"
    "if path and sys.argv[1] != '-': open(path, 'w').write(sys.argv[1])\n"
    "print('Traceback: it broke', flush=True)\n"
    "sys.exit(int(sys.argv[2]))\n"
)


def _ctx() -> EnvContext:
    return EnvContext(lambda ns, n: None, lambda ns, n: None, "127.0.9.4", "127.0.0.1", {})


def test_the_file_wins_and_the_log_is_the_fallback_on_error_only(tmp_path):
    message, log = tmp_path / "c.termination-log", tmp_path / "c.log"
    log.write_text("line 1\nline 2\n")
    message.write_text("ValueError: no weights")
    assert termination_message(FALLBACK, message, log, 1) == "ValueError: no weights"
    message.write_text("")
    assert termination_message(FALLBACK, message, log, 1) == "line 1\nline 2\n"
    assert termination_message(FALLBACK, message, log, 0) == ""  # a clean exit has no error to explain
    assert termination_message({}, message, log, 1) == ""  # policy File: the file or nothing
    message.unlink()
    assert termination_message(FALLBACK, message, log, 137) == "line 1\nline 2\n"
    assert termination_message(FALLBACK, message, tmp_path / "no.log", 1) == ""


def test_the_kubelets_limits(tmp_path):
    message, log = tmp_path / "c.termination-log", tmp_path / "c.log"
    message.write_text("a" * 100 + "z" * MAX_FILE_BYTES)
    assert termination_message(FALLBACK, message, log, 1) == "z" * MAX_FILE_BYTES  # the end of the file
    log.write_text("".join(f"{i}\n" for i in range(200)))
    assert log_tail(log) == "".join(f"{i}\n" for i in range(200 - MAX_LOG_LINES, 200))
    log.write_text("early\n" + "x" * (MAX_LOG_BYTES * 2) + "\nlast\n")
    tail = log_tail(log)
    assert len(tail.encode()) <= MAX_LOG_BYTES and tail.endswith("x\nlast\n") and "early" not in tail


def test_the_path_the_container_is_told_becomes_its_own_file(tmp_path):
    own = tmp_path / "worker.termination-log"
    container = {
        "name": "worker",
        "command": ["w", "--last-words", "$(LAST_WORDS)"],
        "env": [{"name": "LAST_WORDS", "value": "/dev/termination-log"}, {"name": "OTHER", "value": "/dev/null"}],
    }
    plan = plan_launch(POD, container, _ctx(), [], None, tmp_path, own)
    assert plan.env["LAST_WORDS"] == str(own) and plan.env["OTHER"] == "/dev/null"
    assert plan.argv == ["w", "--last-words", str(own)]
    moved = {**container, "terminationMessagePath": "/var/log/last"}
    moved["env"] = [{"name": "LAST_WORDS", "value": "/var/log/last"}]
    assert plan_launch(POD, moved, _ctx(), [], None, tmp_path, own).env["LAST_WORDS"] == str(own)


def _slot(tmp_path: Path, container: dict) -> tuple[ContainerSlot, threading.Event]:
    exited = threading.Event()
    slot = ContainerSlot(
        spec=container,
        record=ContainerRecord("worker", ""),
        log_path=tmp_path / "worker.log",
        previous_log_path=tmp_path / "worker.previous.log",
        pidfile=tmp_path / "worker.pid",
        termination_log_path=tmp_path / "worker.termination-log",
        pod_ip="127.0.9.4",
        restart_policy="Always",
        kill_grace_s=1.0,
        on_exit=exited.set,
        backoff=(0.01, 0.01, 60.0),  # the runs below are started by hand: only the reported state counts
    )
    return slot, exited


def _run_once(slot: ContainerSlot, exited: threading.Event, args: list[str], tmp_path: Path) -> dict:
    container = {**slot.spec, "args": args}
    slot.spec = container
    exited.clear()
    slot.start(plan_launch(POD, container, _ctx(), [], None, tmp_path, slot.termination_log_path), time.monotonic())
    assert exited.wait(30), "the container did not exit"
    slot.step(time.monotonic())
    terminated: dict = slot.record.last_state["terminated"]
    return terminated


def test_a_crashing_container_reports_what_it_wrote_then_its_log(tmp_path):
    container = {
        "name": "worker",
        "command": [sys.executable, "-c", LAST_WORDS],
        "env": [{"name": "LAST_WORDS", "value": "/dev/termination-log"}],
        **FALLBACK,
    }
    slot, exited = _slot(tmp_path, container)
    first = _run_once(slot, exited, ["FileNotFoundError: no weights in /srv/x", "3"], tmp_path)
    assert (first["exitCode"], first["reason"]) == (3, "Error")
    assert first["message"] == "FileNotFoundError: no weights in /srv/x"
    # As the kubelet: a first crash restarts at once (the dead container shows meanwhile), the next backs off.
    assert slot.record.state["terminated"]["exitCode"] == 3
    # The next run writes nothing: the earlier run's message is not read again; its own log's tail is.
    second = _run_once(slot, exited, ["-", "1"], tmp_path)
    assert second["message"] == "loading...\nTraceback: it broke\n"
    assert slot.record.restart_count == 1
    assert slot.record.state["waiting"]["reason"] == "CrashLoopBackOff"
