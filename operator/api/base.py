"""Base class for the API models and the one-source CEL rules.

A cross-field rule is written once as a `CelRule`: its CEL text goes into the CRD (`x-kubernetes-validations`, checked
by the API server) and its Python twin runs in pydantic's validation, both with the same human message. The unit tests
evaluate the CEL text too (cel-python), so the two halves of a rule cannot silently disagree.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class CelRule:
    """One cross-field check. `rule` is CEL over `self` (this object); `holds` is the same check in Python."""

    rule: str
    message: str
    holds: Callable[[Any], bool]
    # Where the API server points the error, relative to this object (e.g. ".expertParallel").
    field_path: str | None = None

    def to_schema(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def _add_cel_rules(schema: dict[str, Any], cls: type) -> None:
    rules: tuple[CelRule, ...] = getattr(cls, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]


class ApiModel(BaseModel):
    """Spec-side models: strict like the API server (no "3" for 3), unknown fields refused, camelCase on the wire."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
        json_schema_extra=_add_cel_rules,
    )
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Self:
        for rule in type(self).cel_rules:
            if not rule.holds(self):
                raise ValueError(rule.message)
        return self


class StatusModel(BaseModel):
    """Status-side models: written by the operator, read back from JSON (timestamps as strings), so not strict.

    Unknown fields are ignored, not refused: a newer operator may have left fields this one does not know (the CRD
    is never downgraded, so they stay valid), and refusing them would stop the model from being reconciled at all.
    """

    model_config = ConfigDict(
        extra="ignore",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
    )


def nested(model: type[ApiModel]) -> Any:
    """A nested object that may be omitted. The CRD default is the whole default object, not `{}`: the API server
    validates a default (CEL rules included) as written, without filling in the defaults inside it."""
    default = model().model_dump(mode="json", by_alias=True, exclude_none=True)
    return Field(default_factory=model, json_schema_extra={"default": default})
