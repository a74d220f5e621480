"""The tool-call formats by name: the one a model's architecture implies (models/registry.py), or the one the
operator names with `tool_call_parser`."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tidal.worker.server.tool_calls import llama, mistral, qwen
from tidal.worker.server.tool_calls.format import ToolCallFormat

TOOL_CALL_FORMATS: Mapping[str, ToolCallFormat] = MappingProxyType(
    {fmt.name: fmt for fmt in (qwen.FORMAT, llama.FORMAT, mistral.FORMAT)}
)


def choose_format(parser: str, architecture_format: str | None) -> ToolCallFormat | None:
    """`parser` "auto": the architecture's format (None: the model has none known, tool calls are refused)."""
    name = architecture_format if parser == "auto" else parser
    return TOOL_CALL_FORMATS.get(name) if name is not None else None
