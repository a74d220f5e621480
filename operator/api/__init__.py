"""The InferenceModel API: pydantic models that are the one source of the CRD schema, the docs and validation."""
