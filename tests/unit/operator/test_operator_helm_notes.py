"""The chart's NOTES (what `helm install` prints): every command in it names things that exist. The kubectl commands
name the CRD's resource names, the example model, the Deployment, Service, labels and port the chart and the
operator build; each patch leaves a valid model; the files and modules they mention are in the repository with the
flags used; the helm upgrade names this release and sets values the chart's schema accepts. (`helm template` leaves
NOTES.txt out, so the test renders it as a template of a copy of the chart.)"""

import ast
import copy
import importlib.util
import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema_check import check_object
from test_operator_helm_chart import CHART, HELM

from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders.pod import build_pod
from tidal.operator.builders.services import build_serving_service
from tidal.operator.schema.crd import build_crd, openapi_schema

REPO = CHART.parents[1]
NAMESPACE = "tidal-system"
RELEASE = "tidal"
pytestmark = pytest.mark.skipif(HELM is None, reason="helm not built (hack/build-binaries.sh); CI has it")


def _render(tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    """(the NOTES text, the chart's manifests), both rendered with the default values."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_under_test.tpl").write_text(
        f'{{{{- define "notes.under.test" -}}}}\n{notes}{{{{- end -}}}}\n'
    )
    (chart / "templates" / "notes-under-test.yaml").write_text(
        'kind: RenderedNotes\ntext: {{ include "notes.under.test" . | toJson }}\n'
    )
    out = subprocess.run(
        [HELM, "template", RELEASE, str(chart), "--namespace", NAMESPACE],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(out) if d]
    (rendered,) = [d for d in docs if d["kind"] == "RenderedNotes"]
    return rendered["text"], [d for d in docs if d["kind"] != "RenderedNotes"]


def _render_with(flags: list[str]) -> None:
    """Render the chart with these value flags (helm checks them against values.schema.json)."""
    subprocess.run(
        [HELM, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *flags],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _commands(notes: str) -> list[list[str]]:
    """The command lines (continuations joined), split like a shell, without trailing comments."""
    lines, joined = [], ""
    for line in notes.splitlines():
        joined += line.strip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if joined.split(" ", 1)[0] in ("kubectl", "python", "curl", "helm"):
            lines.append(shlex.split(joined, comments=True))
        joined = ""
    return lines


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (what `kubectl patch --type merge` sends)."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _module_flags(module: str) -> set[str]:
    """The option strings the module's argparse parser declares (read from its source: no import, no torch)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"no module {module}"
    tree = ast.parse(Path(spec.origin).read_text())
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    }


def test_every_command_in_the_notes_names_what_exists(tmp_path):
    notes, manifests = _render(tmp_path)
    commands = _commands(notes)
    assert len(commands) >= 10, notes
    names = build_crd()["spec"]["names"]
    resources = {names["plural"], names["singular"], *names["shortNames"]}
    deployment = next(m for m in manifests if m["kind"] == "Deployment")["metadata"]["name"]
    services = {m["metadata"]["name"] for m in manifests if m["kind"] == "Service"}
    assert f"service {deployment}-metrics," in notes and f"{deployment}-metrics" in services

    assert [c[:2] for c in commands if c[0] == "helm"] == [["helm", "upgrade"]], notes
    applied = [c for c in commands if c[:2] == ["kubectl", "apply"]]
    assert len(applied) == 1
    example = yaml.safe_load((REPO / _option(applied[0], "-f")).read_text())
    model = InferenceModel.model_validate({**example, "metadata": {**example["metadata"], "namespace": "default"}})
    name, volume = model.metadata.name, model.spec.model.volume.host_path
    assert volume is not None
    service = build_serving_service(model)
    pod_labels = build_pod(model, 0, 0)["metadata"]["labels"]
    written = set()  # directories the notes write models to
    patched_sources = []

    for args in commands:
        if args[0] == "python":
            module = _option(args, "-m")
            flags = {a for a in args if a.startswith("--")}
            assert flags <= _module_flags(module), args
            written.add(_option(args, "--out"))
            continue
        if args[0] == "helm":
            assert args[1:3] == ["upgrade", RELEASE] and REPO / args[3] == CHART, args
            assert _option(args, "-n") == NAMESPACE and "--reuse-values" in args, args
            _render_with([a for a in args[4:] if a not in ("--reuse-values", "-n", NAMESPACE)])
            continue
        if args[0] == "curl":
            url = next(a for a in args if "/v1/" in a)
            assert url.startswith(f"localhost:{service['spec']['ports'][0]['port']}/"), url
            assert json.loads(_option(args, "-d"))["model"] == name  # the served name defaults to the object's
            continue
        words = args[1:]
        if "-n" in words:
            assert _option(words, "-n") == NAMESPACE
            at = words.index("-n")
            words = words[:at] + words[at + 2 :]
        verb, rest = words[0], words[1:]
        if verb == "rollout":
            assert rest[:2] == ["status", f"deployment/{deployment}"], args
        elif verb == "port-forward":
            assert rest[0] == f"svc/{service['metadata']['name']}", args
            assert rest[1].split(":")[1] == str(service["spec"]["ports"][0]["port"]), args
        elif verb == "get" and rest[0] == "pods":
            for pair in _option(rest, "-l").split(","):
                key, value = pair.split("=")
                assert pod_labels.get(key) == value, (pair, pod_labels)
        elif verb in ("get", "describe", "patch"):
            assert rest[0] in resources and rest[1] == name, args
            if verb == "patch":
                assert _option(rest, "--type") == "merge"
                changed = _merge(
                    model.model_dump(mode="json", by_alias=True, exclude_none=True), json.loads(_option(rest, "-p"))
                )
                InferenceModel.model_validate(changed)
                assert check_object(openapi_schema(), changed) == [], args
                if "weights" in changed["spec"]:
                    patched_sources.append(changed["spec"]["weights"]["source"])
        elif verb != "apply":
            raise AssertionError(f"a command the test does not know: {args}")

    # The models the notes write are where the example and the weights patch read them (through the hostPath).
    assert f"{volume.path}/{model.spec.model.path}" in written
    assert patched_sources and all(f"{volume.path}/{source}" in written for source in patched_sources)
