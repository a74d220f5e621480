"""The tool fields of a chat request: function definitions, a named tool_choice, and the calls of a replayed
assistant turn."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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
