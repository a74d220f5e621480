"""A write the API server refused for what it was sent (decoding, validation, admission, quota), told apart from a
failure to reach it, a conflict or throttling: a refusal is news for the model's status, the others are retried by
the next pass."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

# 400 BadRequest (the object cannot be decoded: a quantity such as `lots`), 403 Forbidden (an admission plugin or
# webhook, a quota, missing permissions), 413 (too large), 422 Invalid (validation).
REFUSAL_CODES = frozenset({400, 403, 413, 422})


@dataclass(frozen=True)
class Refusal:
    code: int
    message: str
    # The object's name as the API server reports it in `details` (a dry run's generated name), if it does.
    name: str | None = None

    @property
    def over_quota(self) -> bool:
        """ResourceQuota's denial: about the room left in the namespace, not about the object itself."""
        return self.code == 403 and "exceeded quota" in self.message

    @property
    def dry_run_unsupported(self) -> bool:
        """A webhook with side effects cannot take a dry run: the question was refused, not the object."""
        return "does not support dry run" in self.message


class RefusedError(Exception):
    """Raised by the client's writes for a refusal (ApiException stays for everything else)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


def _status(exc: ApiException) -> dict[str, Any]:
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def refusal_of(exc: ApiException) -> Refusal | None:
    """The refusal `exc` carries (the API server's Status message), or None when it is not one."""
    if exc.status not in REFUSAL_CODES:
        return None
    status = _status(exc)
    message = status.get("message") or exc.reason or f"HTTP {exc.status}"
    name = (status.get("details") or {}).get("name")
    return Refusal(code=int(exc.status), message=str(message), name=str(name) if name else None)
