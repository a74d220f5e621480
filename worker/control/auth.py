"""The control API's bearer token: where it comes from, and the constant-time check of every call.

The token comes from TIDAL_CONTROL_TOKEN (in Kubernetes, a Secret key as an environment variable) or from the file
named by TIDAL_CONTROL_TOKEN_FILE (a mounted Secret). Without one the control API is not started at all: an
unauthenticated control port would let anyone put the model to sleep or replace its weights. The token is never
logged or echoed; errors about it name the variable, not the value.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from pydantic import SecretStr

MIN_TOKEN_LENGTH = 16


class ControlTokenError(ValueError):
    pass


def resolve_control_token(token: SecretStr | None, token_file: Path | None) -> SecretStr | None:
    """The configured token, or None when neither source is set. Raises ControlTokenError for a bad setting."""
    if token is not None and token_file is not None:
        raise ControlTokenError("set only one of TIDAL_CONTROL_TOKEN and TIDAL_CONTROL_TOKEN_FILE")
    if token_file is not None:
        try:
            value = token_file.read_text().strip()
        except OSError as err:
            raise ControlTokenError(f"cannot read the control token file {token_file}: {err.strerror}") from None
        source = f"the control token file {token_file}"
    elif token is not None:
        value = token.get_secret_value().strip()
        source = "TIDAL_CONTROL_TOKEN"
    else:
        return None
    if len(value) < MIN_TOKEN_LENGTH:
        raise ControlTokenError(f"{source} holds a token shorter than {MIN_TOKEN_LENGTH} characters")
    return SecretStr(value)


def is_authorized(header: str | None, token: SecretStr) -> bool:
    """`header` is the Authorization header; the comparison takes the same time wherever the strings differ."""
    scheme, _, presented = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        presented = ""
    return hmac.compare_digest(presented.strip().encode(), token.get_secret_value().encode())
