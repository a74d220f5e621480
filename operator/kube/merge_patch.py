"""Bodies of the JSON merge patches (RFC 7386) the operator sends for the children it owns.

A merge patch merges maps key by key and removes a key only where the patch names it with null. For most of a
child's manifest that is what Tidal wants (the API server keeps the fields it filled in, like a Service's clusterIP),
but a Service's selector must be exactly the one Tidal built: a key left over from an older selector would narrow
it (a Service moved from `tidal.dev/leader` to `tidal.dev/serving` would select only pods carrying both).
"""

import copy
from typing import Any


def service_patch(desired: dict[str, Any], live: dict[str, Any] | None) -> dict[str, Any]:
    """`desired` with null for every selector key the live Service has and `desired` lacks."""
    stale = (live or {}).get("spec", {}).get("selector") or {}
    wanted: dict[str, Any] = desired["spec"].get("selector") or {}
    removed = {key: None for key in stale if key not in wanted}
    if not removed:
        return desired
    body = copy.deepcopy(desired)
    body["spec"]["selector"] = {**removed, **wanted}
    return body
