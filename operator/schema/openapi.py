"""pydantic JSON Schema -> Kubernetes structural OpenAPI v3 schema.

Structural means: every node typed, no $ref, no anyOf/oneOf, `properties` never beside `additionalProperties`, and
`x-kubernetes-preserve-unknown-fields` only where a model asks for it. The converter refuses any keyword it does not
know, so a new pydantic construct fails loudly here instead of producing a schema the API server rejects.
"""

import re
from typing import Any

# Keywords copied through as they are (after conversion of nested schemas).
_PLAIN_KEYWORDS = {
    "type",
    "description",
    "enum",
    "format",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
    "nullable",
}
_DROPPED_KEYWORDS = {"title", "$defs"}
# pydantic writes JSON Schema's numeric form (`"exclusiveMinimum": 0`); OpenAPI v3.0, which the API server speaks,
# writes the bound in `minimum` and flags it exclusive.
_EXCLUSIVE_BOUNDS = {"exclusiveMinimum": "minimum", "exclusiveMaximum": "maximum"}


class SchemaConversionError(ValueError):
    """The pydantic schema uses something a structural CRD schema cannot express."""


def to_structural(schema: dict[str, Any]) -> dict[str, Any]:
    """Convert a `model_json_schema()` result; `$defs` are inlined."""
    return _convert(schema, schema.get("$defs", {}), path="")


def _resolve(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    """Inline a $ref and collapse `Optional[X]` (anyOf [X, null]) to X; sibling keys win over the target's."""
    if "$ref" in node:
        name = node["$ref"].removeprefix("#/$defs/")
        if name not in defs:
            raise SchemaConversionError(f"{path}: unknown $ref {node['$ref']}")
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**defs[name], **siblings}, defs, path)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o != {"type": "null"}]
        if len(options) != 1:
            raise SchemaConversionError(f"{path}: anyOf with more than one non-null branch is not structural")
        siblings = {k: v for k, v in node.items() if k != "anyOf"}
        resolved = _resolve(options[0], defs, path)
        return {**resolved, **siblings}
    if "oneOf" in node or "allOf" in node:
        raise SchemaConversionError(f"{path}: oneOf/allOf are not supported")
    return node


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    node = _resolve(node, defs, path)
    out: dict[str, Any] = {}
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    for key, value in node.items():
        if key in _DROPPED_KEYWORDS:
            continue
        if key == "description":
            out[key] = " ".join(value.split())
        elif key == "properties":
            out[key] = {name: _convert(sub, defs, f"{path}.{name}") for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs, f"{path}[]")
        elif key == "additionalProperties":
            if value is False or (value is True and preserve):
                # Unknown fields are pruned (and refused by kubectl's strict field validation) anyway.
                continue
            if value is True:
                raise SchemaConversionError(f"{path}: free-form object without x-kubernetes-preserve-unknown-fields")
            out[key] = _convert(value, defs, f"{path}.*")
        elif key == "default":
            if value is None:
                continue  # Optional fields are simply absent.
            out[key] = value
        elif key in _EXCLUSIVE_BOUNDS:
            if _EXCLUSIVE_BOUNDS[key] in node:
                raise SchemaConversionError(f"{path}: both {key} and {_EXCLUSIVE_BOUNDS[key]}")
            out[_EXCLUSIVE_BOUNDS[key]] = value
            out[key] = True
        elif key in _PLAIN_KEYWORDS:
            out[key] = value
        else:
            raise SchemaConversionError(f"{path}: keyword {key!r} has no structural equivalent here")
    if "type" not in out:
        raise SchemaConversionError(f"{path}: every node of a structural schema needs a type")
    if "pattern" in out:
        _check_portable_pattern(out["pattern"], path)
    return out


def _check_portable_pattern(pattern: str, path: str) -> None:
    # The API server uses RE2: look-around and back-references would be accepted by pydantic and refused there.
    if re.search(r"\(\?[=!<]|\\[1-9]", pattern):
        raise SchemaConversionError(f"{path}: pattern {pattern!r} uses look-around or back-references (not RE2)")
