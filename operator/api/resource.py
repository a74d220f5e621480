"""The whole `InferenceModel` object: apiVersion, kind, metadata, spec, status."""

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.operator.api import patterns
from tidal.operator.api.base import ApiModel, CelRule
from tidal.operator.api.constants import API_VERSION, GROUP_SERVICE_SUFFIX, KIND, MAX_NAME_LENGTH
from tidal.operator.api.spec import InferenceModelSpec
from tidal.operator.api.status import InferenceModelStatus

# Where the root rules point their errors. The API server accepts a fieldPath only into the schema, so the CRD's
# metadata declares `name` (the one field besides generateName a CRD may say anything about).
NAME_FIELD_PATH = ".metadata.name"


class ObjectMeta(BaseModel):
    """The parts of metadata the operator reads. Everything else the API server keeps is ignored here."""

    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True)

    name: str = Field(min_length=1)
    namespace: str = "default"
    uid: str = ""
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceModel(ApiModel):
    """An LLM served by Tidal: worker pods, a Service, sleep/wake and in-place weight updates."""

    api_version: Literal["tidal.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["InferenceModel"] = KIND
    metadata: ObjectMeta
    spec: InferenceModelSpec
    status: InferenceModelStatus | None = None

    @field_validator("status", mode="wrap")
    @classmethod
    def _read_status_leniently(cls, value: Any, handler: Any) -> InferenceModelStatus | None:
        # The spec strictly, the status leniently: it is this operator's own output (`InferenceModelStatus.read`).
        if value is None or isinstance(value, InferenceModelStatus):
            return value
        return InferenceModelStatus.read(value)

    # Root rules may read metadata.name only. The name ends up in pod, Service and DNS names, which must be DNS
    # labels of at most 63 characters, so it is bounded here where the user sees the reason. Each names its field:
    # a root rule without a fieldPath is reported at no path, which kubectl prints as "<nil>: Invalid value".
    cel_rules = (
        CelRule(
            rule=f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
            message=f"metadata.name must be at most {MAX_NAME_LENGTH} characters: pod and Service names are built "
            "from it",
            holds=lambda m: len(m.metadata.name) <= MAX_NAME_LENGTH,
            field_path=NAME_FIELD_PATH,
        ),
        CelRule(
            rule=f"self.metadata.name.matches('{patterns.DNS_LABEL}')",
            message="metadata.name must be a DNS label (lowercase letters, digits and '-', starting with a letter): "
            "it names the model's Service",
            holds=lambda m: re.search(patterns.DNS_LABEL, m.metadata.name) is not None,
            field_path=NAME_FIELD_PATH,
        ),
        CelRule(
            rule=f"!self.metadata.name.endsWith('{GROUP_SERVICE_SUFFIX}')",
            message=f"metadata.name must not end in '{GROUP_SERVICE_SUFFIX}': the model named <name> owns the "
            f"headless Service <name>{GROUP_SERVICE_SUFFIX}, which this model's Service would collide with",
            holds=lambda m: not m.metadata.name.endswith(GROUP_SERVICE_SUFFIX),
            field_path=NAME_FIELD_PATH,
        ),
    )
