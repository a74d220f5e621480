"""Reading what the operator itself wrote, leniently: what does not validate is dropped, not refused.

The status is the operator's own output, and every pass that changes it writes it whole. A newer operator may have
left values this one does not know (a phase, a condition type, a rank state: its CRD, which Helm never downgrades,
accepts them). Refusing the object for them would stop the model from being reconciled, and so its status from ever
being rewritten. The spec is the user's input and stays strict.
"""

import copy
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

# Each round drops one value; a status has far fewer than this, so reaching it means something else is wrong.
MAX_DROPS = 256
WHOLE = "(all of it)"


def read_leniently(cls: type[M], data: Any) -> tuple[M, tuple[str, ...]]:
    """`data` as `cls`, and the paths dropped to get there ("phase", "conditions.1"; WHOLE when nothing could be
    kept). Each round drops the deepest value an error's location reaches: an unknown value goes, so its field falls
    back to its default; a field that cannot go (required) is missing in the next round, which drops the object
    holding it (a list entry, or an optional object)."""
    work = copy.deepcopy(data)
    dropped: list[str] = []
    for _ in range(MAX_DROPS):
        try:
            return cls.model_validate(work), tuple(dropped)
        except ValidationError as exc:
            path = _deepest_existing(work, exc.errors()[0]["loc"])
            if not path:
                break
            _drop(work, path)
            dropped.append(".".join(str(part) for part in path))
    return cls(), (*dropped, WHOLE)


def _deepest_existing(data: Any, loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    node: Any = data
    found: tuple[int | str, ...] = ()
    for part in loc:
        in_dict = isinstance(node, dict) and isinstance(part, str) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (in_dict or in_list):
            break
        node = node[part]
        found = (*found, part)
    return found


def _drop(data: Any, path: tuple[int | str, ...]) -> None:
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    del parent[path[-1]]
