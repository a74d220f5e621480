"""Markdown field table for docs/API.md, rendered from the same structural schema as the CRD."""

import json
from collections.abc import Iterator
from typing import Any

BEGIN_MARKER = "<!-- BEGIN GENERATED: python -m tidal.operator.crdgen -->"
END_MARKER = "<!-- END GENERATED -->"


def _type_name(node: dict[str, Any]) -> str:
    kind: str = node.get("type", "")
    if kind == "array":
        return f"[]{_type_name(node['items'])}"
    if kind == "object" and "additionalProperties" in node:
        return f"map[string]{_type_name(node['additionalProperties'])}"
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (free-form)"
    return kind


def _constraints(node: dict[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in node["enum"]))
    if "minimum" in node or "maximum" in node:
        low = f"{node.get('minimum', '')}{' (excluded)' if node.get('exclusiveMinimum') else ''}"
        high = f"{node.get('maximum', '')}{' (excluded)' if node.get('exclusiveMaximum') else ''}"
        parts.append(f"{low}..{high}")
    if "minLength" in node or "maxLength" in node:
        parts.append(f"length {node.get('minLength', 0)}..{node.get('maxLength', '')}")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    if "maxProperties" in node:
        parts.append(f"at most {node['maxProperties']} entries")
    if "format" in node:
        parts.append(f"format {node['format']}")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    return "; ".join(parts)


def _walk(node: dict[str, Any], path: str, required: bool) -> Iterator[tuple[str, dict[str, Any], bool]]:
    yield path, node, required
    children = node.get("properties", {})
    if node.get("type") == "array" and "properties" in node.get("items", {}):
        path, node = f"{path}[]", node["items"]
        children = node["properties"]
    for name, child in children.items():
        yield from _walk(child, f"{path}.{name}", name in node.get("required", []))


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    if isinstance(node["default"], dict) and node["default"]:
        return "its fields' defaults"  # the whole object is the default; each field's row shows its part
    return f"`{json.dumps(node['default'])}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def field_table(schema: dict[str, Any], root: str) -> str:
    """Rows for every field under `root` (e.g. "spec"), then its cross-field (CEL) rules; the object-level rules
    (on metadata.name) are listed with the spec, which is what a user edits."""
    lines = [
        "| Field | Type | Required | Default | Validation | Description |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rules = []
    if root == "spec":
        rules += [
            f"| `{r.get('fieldPath', '(object)').lstrip('.')}` | `{_cell(r['rule'])}` | {_cell(r['message'])} |"
            for r in schema.get("x-kubernetes-validations", [])
        ]
    for path, node, required in _walk(schema["properties"][root], root, root in schema.get("required", [])):
        default = _default(node)
        lines.append(
            f"| `{path}` | {_type_name(node)} | {'yes' if required else ''} | {_cell(default)} "
            f"| {_cell(_constraints(node))} | {_cell(node.get('description', ''))} |"
        )
        for rule in node.get("x-kubernetes-validations", []):
            rules.append(f"| `{path}` | `{_cell(rule['rule'])}` | {_cell(rule['message'])} |")
        # A list's rules on each of its items (a toleration, a pod template's volume mount).
        for rule in node.get("items", {}).get("x-kubernetes-validations", []) if node.get("type") == "array" else []:
            rules.append(f"| `{path}[]` | `{_cell(rule['rule'])}` | {_cell(rule['message'])} |")
    if rules:
        lines += ["", "Cross-field rules (CEL, checked by the API server and by the pydantic model alike):", ""]
        lines += ["| Where | Rule | Message |", "| --- | --- | --- |", *rules]
    return "\n".join(lines)


def render_block(schema: dict[str, Any]) -> str:
    return "\n".join(
        [
            BEGIN_MARKER,
            "### Spec fields",
            "",
            field_table(schema, "spec"),
            "",
            "### Status fields",
            "",
            field_table(schema, "status"),
            END_MARKER,
        ]
    )


def replace_block(document: str, block: str) -> str:
    """Swap the generated block inside a hand-written document; the text around it is kept."""
    start, end = document.find(BEGIN_MARKER), document.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"docs/API.md lacks the markers {BEGIN_MARKER!r} ... {END_MARKER!r}")
    return document[:start] + block + document[end + len(END_MARKER) :]
