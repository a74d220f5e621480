"""The generated CRD is structural, current on disk, and agrees with pydantic on every limit it states."""

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from crd_schema_check import check_object, resolve_field_path, validate
from pydantic import ValidationError

from tidal.operator import crdgen
from tidal.operator.api.resource import InferenceModel
from tidal.operator.schema.crd import build_crd, openapi_schema
from tidal.operator.schema.openapi import SchemaConversionError, to_structural

REPO = Path(__file__).resolve().parents[3]
SCHEMA = openapi_schema()

# Every optional object present, one item in each list: the walk below probes every field it reaches.
FULL: dict[str, Any] = {
    "apiVersion": "tidal.dev/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "full"},
    "spec": {
        "model": {
            "volume": {"hostPath": {"path": "/srv/models"}, "mountPath": "/models"},
            "path": "qwen3-0.6b",
            "dtype": "bfloat16",
            "maxModelLen": 4096,
            "servedName": "qwen",
        },
        "worker": {
            "image": "registry.example/tidal-worker:1",
            "imagePullPolicy": "Always",
            "resources": {"gpusPerRank": 1, "gpuResourceName": "nvidia.com/gpu", "cpu": "4", "memory": "32Gi"},
            "nodeSelector": {"gpu": "h200"},
            "tolerations": [{"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}],
            "env": [{"name": "HF_HOME", "value": "/tmp/hf"}],
            "podTemplate": {"metadata": {"labels": {"team": "a"}, "annotations": {"x": "y"}}, "spec": {}},
        },
        "replicas": 2,
        "expertParallel": 4,
        "experts": {"redundantExpertsPerRank": 2, "collectiveTimeoutSeconds": 2.5},
        "serving": {"port": 8000, "controlPort": 8001},
        "sleep": {"state": "Awake", "level": 1, "idleTimeoutSeconds": 600},
        "weights": {"version": "v2", "source": "checkpoints/v2"},
        "updateStrategy": {"maxUnavailable": 1},
    },
}
STRING_PROBES = ["", "x", "X", "/abs/dir", "rel/dir", "a/../b", "..", "500m", "16Gi", "lots", "a.b", "nvidia.com/gpu"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")


def test_schema_is_structural():
    preserved = []
    for path, node in _walk(SCHEMA):
        assert "type" in node, f"{path} has no type"
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "not", "$defs", "title", "const"):
            assert banned not in node, f"{path} has {banned}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.append(path)
        if node["type"] == "array" and path.startswith(".spec"):
            assert "maxItems" in node, f"{path}: CEL cost estimation needs bounded lists"
    # The pod template's spec is free-form; only where its containers mount volumes is declared (for a CEL rule),
    # keeping the rest of each container and mount.
    assert preserved == [
        ".spec.worker.podTemplate.spec",
        ".spec.worker.podTemplate.spec.containers[]",
        ".spec.worker.podTemplate.spec.containers[].volumeMounts[]",
        ".spec.worker.podTemplate.spec.initContainers[]",
        ".spec.worker.podTemplate.spec.initContainers[].volumeMounts[]",
    ]
    # A CRD may say nothing about metadata but the types of name and generateName.
    assert SCHEMA["properties"]["metadata"] == {"type": "object", "properties": {"name": {"type": "string"}}}


def test_every_cel_rule_compiles_and_defaults_validate():
    env = celpy.Environment()
    rules = 0
    for path, node in _walk(SCHEMA):
        for rule in node.get("x-kubernetes-validations", []):
            env.compile(rule["rule"])
            assert rule["message"] and not rule["message"].endswith("."), path
            rules += 1
        if "default" in node:
            # The API server validates a default as written (CEL rules too), without defaulting inside it.
            assert validate(node, node["default"], path) == [], path
    assert rules >= 10


def test_every_cel_rule_on_the_whole_object_names_a_field_that_exists():
    # Without a fieldPath the API server reports a root rule at no path, which kubectl prints as "<nil>: Invalid
    # value"; a fieldPath that is not in the schema makes the API server refuse the CRD.
    root_rules = SCHEMA["x-kubernetes-validations"]
    assert root_rules and all(rule.get("fieldPath") for rule in root_rules)
    for path, node in _walk(SCHEMA):
        for rule in node.get("x-kubernetes-validations", []):
            if "fieldPath" in rule:
                assert resolve_field_path(node, rule["fieldPath"])["type"], path


def test_exclusive_bounds_become_openapi_v3_0_flags():
    timeout = SCHEMA["properties"]["spec"]["properties"]["experts"]["properties"]["collectiveTimeoutSeconds"]
    assert timeout["type"] == "number"
    assert (timeout["minimum"], timeout["exclusiveMinimum"], timeout["maximum"]) == (0, True, 600)
    assert to_structural({"type": "number", "exclusiveMaximum": 5}) == {
        "type": "number",
        "maximum": 5,
        "exclusiveMaximum": True,
    }
    with pytest.raises(SchemaConversionError, match="both"):
        to_structural({"type": "number", "minimum": 1, "exclusiveMinimum": 0})


def test_converter_refuses_non_structural_input():
    with pytest.raises(SchemaConversionError, match="anyOf"):
        to_structural({"anyOf": [{"type": "string"}, {"type": "integer"}]})
    with pytest.raises(SchemaConversionError, match="type"):
        to_structural({"description": "untyped"})
    with pytest.raises(SchemaConversionError, match="free-form"):
        to_structural({"type": "object", "additionalProperties": True})
    with pytest.raises(SchemaConversionError, match="RE2"):
        to_structural({"type": "string", "pattern": "^(?!x)"})


def test_crd_metadata():
    crd = build_crd()
    names = crd["spec"]["names"]
    assert names["shortNames"] == ["tim", "tidalim"] and "im" not in names["shortNames"]
    assert names["categories"] == ["tidal"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Age"] == ".metadata.creationTimestamp"
    assert {"Ready", "Weights", "Sleep"} <= set(columns)
    for path in columns.values():  # printer columns must point at fields the schema has
        node = version["schema"]["openAPIV3Schema"]
        for part in path.strip(".").split("."):
            if part == "metadata":
                break
            node = node["properties"][part]


def test_scale_paths_point_at_fields_of_the_types_the_api_server_needs():
    # The API server reads the replica counts as integers and the selector as a string; a path to a missing field
    # would leave the scale's status empty (and the HPA without a selector) with no error anywhere.
    expected = {"specReplicasPath": "integer", "statusReplicasPath": "integer", "labelSelectorPath": "string"}
    scale = build_crd()["spec"]["versions"][0]["subresources"]["scale"]
    for key, type_ in expected.items():
        node = SCHEMA
        for part in scale[key].strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == type_, key
    spec_replicas = SCHEMA["properties"]["spec"]["properties"]["replicas"]
    assert (spec_replicas["minimum"], spec_replicas["maximum"]) == (0, 64)  # what `kubectl scale` may set


def test_generated_files_are_current():
    stale = crdgen.stale_files(REPO)
    assert stale == [], f"run `python -m tidal.operator.crdgen`; stale: {stale}"
    crd = (REPO / "crds" / crdgen.CRD_FILE).read_text()
    assert crd == (REPO / "charts" / "tidal" / "crds" / crdgen.CRD_FILE).read_text()
    assert yaml.safe_load(crd) == build_crd()


def test_check_mode_reports_drift(tmp_path):
    for rel in ("docs/API.md", f"crds/{crdgen.CRD_FILE}", f"charts/tidal/crds/{crdgen.CRD_FILE}"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text())
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / "crds" / crdgen.CRD_FILE).write_text("# edited by hand\n")
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.stale_files(tmp_path) == []


def _pydantic_accepts(obj: dict[str, Any]) -> bool:
    try:
        InferenceModel.model_validate(obj)
    except ValidationError:
        return False
    return True


def _set(obj: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = obj
    for key in path[:-1]:
        node = node[0] if key == "[]" else node[key]
    last = path[-1]
    if value is _DELETE:
        node.pop(last)
    else:
        node[last] = value


_DELETE = object()


def _probes(node: dict[str, Any]) -> list[Any]:
    kind = node["type"]
    values: list[Any] = list(node.get("enum", []))
    if kind == "integer":
        values += [node.get("minimum", 0) - 1, node.get("minimum", 0), node.get("maximum", 10**6), "1", True]
        values.append(node.get("maximum", 10**6) + 1)
    elif kind == "number":
        low, high = node.get("minimum", 0), node.get("maximum", 10**6)
        values += [low - 1, low, low + 0.001, 1, 2.5, high, high + 0.5, "1", True]
    elif kind == "string":
        values += [*STRING_PROBES, "a" * node.get("maxLength", 300), "a" * (node.get("maxLength", 300) + 1), 7]
    elif kind == "boolean":
        values += [True, False, "true"]
    return [*values, "not-in-any-enum"] if "enum" in node else values


def _leaf_paths(node: dict[str, Any], obj: Any, path: list[str]):
    if node["type"] == "object" and "properties" in node and isinstance(obj, dict):
        for name, sub in node["properties"].items():
            if name in obj:
                yield from _leaf_paths(sub, obj[name], [*path, name])
                yield [*path, name], _DELETE  # required in one means required in the other
    elif node["type"] == "array" and obj:
        yield from _leaf_paths(node["items"], obj[0], [*path, "[]"])
    elif node["type"] not in ("object", "array"):
        for value in _probes(node):
            yield path, value


# The same object with the other volume source, so the PersistentVolumeClaim fields are probed too.
FULL_PVC = copy.deepcopy(FULL)
FULL_PVC["spec"]["model"]["volume"] = {"persistentVolumeClaim": {"claimName": "model-store"}}


def _cases():
    spec_schema = {"type": "object", "properties": {"spec": SCHEMA["properties"]["spec"]}}
    cases = [(FULL, path, value) for path, value in _leaf_paths(spec_schema, {"spec": FULL["spec"]}, [])]
    pvc = FULL_PVC["spec"]["model"]["volume"]
    volume_schema = SCHEMA["properties"]["spec"]["properties"]["model"]["properties"]["volume"]
    prefix = ["spec", "model", "volume"]
    cases += [(FULL_PVC, [*prefix, *path], value) for path, value in _leaf_paths(volume_schema, pvc, [])]
    return cases


def test_full_object_is_valid_for_both():
    assert _pydantic_accepts(FULL)
    assert check_object(SCHEMA, FULL) == []


def _case_id(case) -> str:
    base, path, value = case
    shown = "<delete>" if value is _DELETE else repr(value)[:20]
    return f"{'pvc:' if base is FULL_PVC else ''}{'.'.join(path)}={shown}"


def test_full_pvc_object_is_valid_for_both():
    assert _pydantic_accepts(FULL_PVC)
    assert check_object(SCHEMA, FULL_PVC) == []


@pytest.mark.parametrize("case", _cases(), ids=_case_id)
def test_pydantic_and_schema_agree(case):
    base, path, value = case
    obj = copy.deepcopy(base)
    _set(obj, path, value)
    schema_ok = check_object(SCHEMA, obj) == []
    assert _pydantic_accepts(obj) == schema_ok, check_object(SCHEMA, obj)
