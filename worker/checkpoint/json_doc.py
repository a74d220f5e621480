"""A JSON document from a checkpoint (a safetensors header, an index) as a bounded object: nesting deeper than any
well-formed one is refused as a problem, never met later as a RecursionError where the document is walked or shown.
"""

from __future__ import annotations

import json
import reprlib

# A header is {name: {dtype, shape: [ints], data_offsets: [ints]}} plus string metadata; an index is
# {metadata: {...}, weight_map: {name: file}}: neither goes deeper than 3. The margin admits metadata of other tools.
MAX_DEPTH = 16

_short = reprlib.Repr()
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = 3, 8, 8, 80, 80


def loads_object(data: bytes | str) -> dict[str, object]:
    """-> the JSON object; ValueError (bad JSON, bad UTF-8, not an object, nested too deep)."""
    try:
        document = json.loads(data)
    except RecursionError as err:  # deep enough to exhaust the parser before the depth check can run
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from err
    if not isinstance(document, dict):
        raise ValueError(f"it is not a JSON object but {type(document).__name__}")
    if depth(document) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return document


def depth(value: object) -> int:
    """How deep lists and objects nest in `value` (a scalar is 0), without recursing."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level + 1)
        if deepest > MAX_DEPTH:
            return deepest
        stack += [(child, level + 1) for child in children]
    return deepest


def short(value: object) -> str:
    """A repr of a value from a checkpoint short enough for an error message."""
    return _short.repr(value)
