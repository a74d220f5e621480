"""The InferenceModel API: pydantic models that are the one source of the CRD schema, the docs and validation."""

from tidal.operator.api.resource import InferenceModel
from tidal.operator.api.spec import InferenceModelSpec
from tidal.operator.api.status import InferenceModelStatus

__all__ = ["InferenceModel", "InferenceModelSpec", "InferenceModelStatus"]
