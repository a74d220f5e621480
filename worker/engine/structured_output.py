"""What a request's output must conform to (JSON, a JSON schema, a regex, one of some strings, an EBNF grammar), as
plain data: the key of the compiled-grammar cache and part of the request's SamplingParams (no torch, no xgrammar).

The bounds keep one request from making the grammar compiler (a shared thread pool) or the per-step mask work
unreasonably large; past them the request is refused with a 400 before anything is compiled. The text's length does
not bound a compile's time: schema_cost.py estimates that of a JSON schema, a structural tag's schemas, a regex and an
EBNF grammar (ebnf_cost.py).
"""

from __future__ import annotations

import json
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.worker.engine.schema_cost import check_grammar, check_json_schema, check_regex, check_structural_tag

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, or all choices together
MAX_CHOICES = 256

StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]


class StructuredOutput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: StructuredKind
    # json_schema: the schema as JSON text (sorted keys, so equal schemas share a cache entry); regex and grammar: the
    # pattern or EBNF text; choice: a JSON list of the strings; structural_tag: xgrammar's structural tag as JSON
    # (forced tool calls); json_object: empty.
    text: str = ""
    strict: bool = Field(default=True, description="json_schema: no properties beyond the schema's.")

    @classmethod
    def json_schema(cls, schema: dict[str, object], strict: bool = True) -> Self:
        return cls(kind="json_schema", text=json.dumps(schema, sort_keys=True), strict=strict)

    @classmethod
    def structural_tag(cls, tag: dict[str, object]) -> Self:
        return cls(kind="structural_tag", text=json.dumps(tag, sort_keys=True))

    @classmethod
    def choice(cls, choices: list[str]) -> Self:
        return cls(kind="choice", text=json.dumps(choices))

    @model_validator(mode="after")
    def _check(self) -> Self:
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {self.kind} may be at most {MAX_GRAMMAR_CHARS} characters, got {len(self.text)}")
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"the {self.kind} must not be empty")
        if self.kind == "choice":
            choices = json.loads(self.text)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES:
                raise ValueError(f"choice may list at most {MAX_CHOICES} strings, got {len(choices)}")
        if self.kind == "json_schema":
            check_json_schema(self.text, self.strict)
        elif self.kind == "structural_tag":
            check_structural_tag(self.text)
        elif self.kind == "regex":
            check_regex(self.text)
        elif self.kind == "grammar":
            check_grammar(self.text)
        return self

    @property
    def choices(self) -> list[str]:
        return list(json.loads(self.text)) if self.kind == "choice" else []
