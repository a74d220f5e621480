"""The most tokens a prompt may have here, and the 400 that refuses one over it (pure).

Two limits apply: the operator's `max_prompt_tokens` and the model's context, less the one token that must be
generated. The smaller one is the prompt's limit, named in the refusal with the words the server has always used for
it (the engine's own refusal says the same of the context: `engine.errors.PromptTooLongError`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.worker.server.errors import ApiError
from tidal.worker.server.token_floor import TokenFloor


@dataclass(frozen=True)
class PromptLimit:
    max_tokens: int
    whose: str  # "this worker accepts at most 32 (max_prompt_tokens)"

    @classmethod
    def of(cls, max_model_len: int, max_prompt_tokens: int | None) -> PromptLimit:
        in_context = max_model_len - 1
        if max_prompt_tokens is not None and max_prompt_tokens <= in_context:
            return cls(max_prompt_tokens, f"this worker accepts at most {max_prompt_tokens} (max_prompt_tokens)")
        return cls(
            in_context,
            f"this model accepts at most {in_context} (max_model_len is {max_model_len}, and at least one token "
            "must be generated)",
        )

    def check_text(self, floor: TokenFloor | None, text: str, param: str) -> None:
        """400 for a text that cannot encode to few enough tokens, before it is tokenized."""
        if floor is None:
            return
        needed = floor.min_tokens(text)
        if needed > self.max_tokens:
            raise self.refusal(f"at least {needed}", param)

    def check_count(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_tokens:
            raise self.refusal(str(num_tokens), param)

    def refusal(self, num_tokens: str, param: str) -> ApiError:
        message = f"the prompt has {num_tokens} tokens but {self.whose}"
        return ApiError(400, message, param=param, code="context_length_exceeded")
