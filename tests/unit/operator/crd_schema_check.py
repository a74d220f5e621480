"""A small stand-in for the API server's CRD validation, for unit tests: defaulting, structural OpenAPI validation
(types, enums, bounds, lengths, patterns, required, unknown fields as kubectl's strict field validation reports them)
and CEL rules evaluated with cel-python. It checks our generated schema against the same table of objects that the
e2e tests send to the real API server; it is not a replacement for that test."""

import copy
import json
import re
from typing import Any

import celpy

_TYPES = {
    "string": lambda v: isinstance(v, str),
    # The API server reads a JSON 1.0 as a float and takes it for an integer field (and stores 1).
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
_CEL = celpy.Environment()


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill absent properties that have a default, then recurse (what the API server does on create)."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        value = {k: apply_defaults(schema["additionalProperties"], v) for k, v in value.items()}
    return value


def validate(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Errors as '<path>: <message>' lines; empty when the value is accepted."""
    errors: list[str] = []
    kind = schema.get("type")
    if value is None and schema.get("nullable"):
        return []
    if kind and not _TYPES[kind](value):
        return [f"{path}: must be of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(json.dumps(v) for v in schema["enum"])
        errors.append(f"{path}: Unsupported value: {json.dumps(value)}: supported values: {supported}")
    errors += _bounds(schema, value, path)
    if kind == "string":
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: should be at least {schema['minLength']} chars long")
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{path}: may not be more than {schema['maxLength']} bytes")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            errors.append(f"{path}: should match '{schema['pattern']}'")
    if kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: must have at most {schema['maxItems']} items")
        for i, item in enumerate(value):
            errors += validate(schema["items"], item, f"{path}[{i}]")
    if kind == "object" and not schema.get("x-kubernetes-preserve-unknown-fields"):
        errors += _validate_object(schema, value, path)
    elif kind == "object":  # unknown fields are kept, the declared ones still checked
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                errors += validate(sub, value[name], f"{path}.{name}")
    if not errors:
        errors += _cel(schema, value, path)
    return errors


def _bounds(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """OpenAPI v3.0 bounds: `exclusiveMinimum: true` makes `minimum` itself out of range (same for the maximum)."""
    errors = []
    if "minimum" in schema:
        if schema.get("exclusiveMinimum") and value <= schema["minimum"]:
            errors.append(f"{path}: should be greater than {schema['minimum']}")
        elif value < schema["minimum"]:
            errors.append(f"{path}: should be greater than or equal to {schema['minimum']}")
    if "maximum" in schema:
        if schema.get("exclusiveMaximum") and value >= schema["maximum"]:
            errors.append(f"{path}: should be less than {schema['maximum']}")
        elif value > schema["maximum"]:
            errors.append(f"{path}: should be less than or equal to {schema['maximum']}")
    return errors


def _validate_object(schema: dict[str, Any], value: dict[str, Any], path: str) -> list[str]:
    errors = []
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    if len(value) > schema.get("maxProperties", len(value)):
        errors.append(f"{path}: must have at most {schema['maxProperties']} items")
    for name in schema.get("required", []):
        if name not in value:
            errors.append(f"{path}.{name}: Required value")
    for name, sub in value.items():
        if props is not None and name in props:
            errors += validate(props[name], sub, f"{path}.{name}")
        elif isinstance(extra, dict):
            errors += validate(extra, sub, f"{path}.{name}")
        elif props is not None and path != ".metadata":  # the API server checks ObjectMeta itself
            errors.append(f'{path}: unknown field "{path.lstrip(".")}.{name}"')
    return errors


def _cel(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _CEL.program(_CEL.compile(rule["rule"]))
        try:
            result = program.evaluate({"self": celpy.json_to_cel(_without_nulls(value))})
        except celpy.CELEvalError as err:  # e.g. a rule reading an absent field: the API server refuses too
            result = err
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):  # an evaluation error fails too
            field_path = rule.get("fieldPath", "")
            resolve_field_path(schema, field_path)
            # A rule on the whole object without a fieldPath has no path at all: the API server prints "<nil>".
            errors.append(f"{path + field_path or '<nil>'}: Invalid value: {rule['message']}")
    return errors


def _without_nulls(value: Any) -> Any:
    """CEL on the API server sees a field that is null as absent."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def resolve_field_path(schema: dict[str, Any], field_path: str) -> dict[str, Any]:
    """The schema node a rule's fieldPath names, from the node the rule sits on; ValueError when there is none (the
    API server refuses such a CRD). Only `.name` steps: the generated rules use no other form."""
    node = schema
    for name in field_path.split(".")[1:] if field_path else []:
        properties = node.get("properties", {})
        if name not in properties:
            raise ValueError(f"fieldPath {field_path!r} does not refer to a valid field")
        node = properties[name]
    return node


def check_object(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Default, then validate, like a create request."""
    return validate(schema, apply_defaults(schema, obj))
