"""Request errors raised before anything is queued; the server turns them into HTTP 400."""

from __future__ import annotations


class RequestRejectedError(ValueError):
    """A request the engine will not accept as it is."""


class PromptTooLongError(RequestRejectedError):
    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens but this model accepts at most {max_model_len - 1} "
            f"(max_model_len is {max_model_len}, and at least one token must be generated)"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class EmptyPromptError(RequestRejectedError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty: at least one token is needed")


class InvalidTokenError(RequestRejectedError):
    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"prompt token id {token_id} is outside the vocabulary [0, {vocab_size})")


class DuplicateRequestError(RequestRejectedError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"a request with id {request_id!r} is already running")


class InvalidLogitBiasError(RequestRejectedError):
    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"logit_bias key {token_id} is outside the vocabulary [0, {vocab_size})")
        self.token_id = token_id


class InvalidGrammarError(RequestRejectedError):
    """A structured output (JSON schema, regex, choice, grammar) that the grammar engine cannot compile."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"invalid {kind}: {message}")
