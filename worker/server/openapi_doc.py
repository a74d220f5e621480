"""The OpenAPI documents the worker's two apps publish, made to say what the servers do.

FastAPI documents a 422 with its own validation-error body for every route that takes a body or parameters; both
apps answer those with a 400 in their own error shape (OpenAI's for the serving API, `ControlError` for the control
API). A client generated from the document, or a contract test such as schemathesis, would otherwise expect the
wrong status and body. The control API also declares its bearer token, which every route requires.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")

BEARER_SCHEME = "bearerToken"


def conform_openapi(app: FastAPI, error_schema: str, *, bearer: bool = False) -> None:
    """Serve a document where validation errors are the 400 the app sends, with the body `error_schema` (a model
    already among the document's schemas) and, with `bearer`, a bearer token required by every route."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, description=app.description,
                routes=app.routes,
            )  # fmt: skip
            _retarget_validation_errors(schema, error_schema)
            if bearer:
                components = schema.setdefault("components", {})
                components.setdefault("securitySchemes", {})[BEARER_SCHEME] = {"type": "http", "scheme": "bearer"}
                schema["security"] = [{BEARER_SCHEME: []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


def _retarget_validation_errors(schema: dict[str, Any], error_schema: str) -> None:
    bad_request = {
        "description": "Bad Request: the body or a parameter is invalid (the message names each problem)",
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error_schema}"}}},
    }
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if _is_fastapis_validation_error(responses.get("422")):
                del responses["422"]
                responses.setdefault("400", bad_request)
    schemas = schema.get("components", {}).get("schemas", {})
    for name in _FASTAPI_VALIDATION_SCHEMAS:
        schemas.pop(name, None)


def _is_fastapis_validation_error(response: dict[str, Any] | None) -> bool:
    """FastAPI's own 422, not one the route declared (the control API's bad_checkpoint is a 422 of its own)."""
    schema = (response or {}).get("content", {}).get("application/json", {}).get("schema", {})
    return bool(schema.get("$ref", "").endswith("/HTTPValidationError"))
