"""Turns the pydantic API models into the CRD manifest and the docs' field table."""
