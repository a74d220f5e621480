"""The Secret holding the control-API bearer token. The caller generates the token; nothing here logs it."""

import base64
from typing import Any

from pydantic import SecretStr

from tidal.operator.api.resource import InferenceModel
from tidal.operator.builders import names
from tidal.operator.builders.owner import object_meta

MIN_TOKEN_LENGTH = 32


def build_token_secret(model: InferenceModel, token: SecretStr) -> dict[str, Any]:
    """`token` is a SecretStr so that it prints as '**********' if an argument list ever gets logged."""
    value = token.get_secret_value()
    if len(value) < MIN_TOKEN_LENGTH:
        raise ValueError(f"the control token must have at least {MIN_TOKEN_LENGTH} characters")
    name = model.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(model, names.token_secret_name(name), names.model_labels(name)),
        "type": "Opaque",
        "data": {names.TOKEN_SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }
