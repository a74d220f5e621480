"""The tool fields of a chat request: function definitions, a named tool_choice, and the calls of a replayed
assistant turn."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_TOOLS = 128
_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
ToolMode = Literal["none", "auto", "required", "named"]


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_TOOL_NAME, description="letters, digits, _ and -, at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_parameters(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        # A call's arguments are a JSON object (every family's format, and OpenAI's): forced to be anything else, the
        # call could not be read back and came back as plain text. A schema that names no type is taken as it is.
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON schema of type object, got type {parameters['type']!r}")
        return parameters

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema; a function without parameters takes an empty object."""
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(pattern=_TOOL_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ReplayedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = Field(description="the arguments as JSON text, as the call returned them")


class MessageToolCall(BaseModel):
    """A call of an earlier assistant turn, replayed so that the template shows the model what it called."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ReplayedFunction
