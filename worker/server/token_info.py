"""The engine's per-token records (TokenLogprob) in the response shapes: the legacy completions one (tokens,
token_logprobs, top_logprobs, text_offset), the chat one (content: [{token, logprob, bytes, top_logprobs}]) and vLLM's
prompt_logprobs ({token id: {logprob, rank, decoded_token}} per prompt position).

A token's text is the tokenizer's decoding of that token alone (a piece of a multi-byte character reads as U+FFFD,
and `bytes` are those of that text), as vLLM does; each id is decoded once per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tidal.worker.engine.outputs import TokenLogprob
from tidal.worker.server.responses import ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob


class TokenTexts:
    """Token id -> its text, decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], k: int, texts: TokenTexts, offset: int
) -> tuple[CompletionLogprobs, int]:
    """Tokens with their records (None: the prompt's first token); `offset`: where the first one's text starts.
    -> the legacy logprobs, and the offset after the last token. Each top_logprobs dict holds the k most likely
    and the token itself, as OpenAI's."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = texts(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for t, lp in entry.top[:k]:  # most likely first: of tokens with the same text, the likelier one stays
            top.setdefault(texts(t), lp)
        top.setdefault(text, entry.logprob)
        tops.append(top)
    logprobs = CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets)
    return logprobs, offset


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> list[ChatTokenLogprob]:
    """One record per generated token; top_logprobs as many as asked (the engine computed that many)."""
    content = []
    for entry in entries:
        text = texts(entry.token_id)
        top = [_top(texts(t), lp) for t, lp in entry.top]
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=top))
    return content


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def prompt_logprobs(
    entries: Sequence[TokenLogprob | None], k: int, texts: TokenTexts
) -> list[dict[str, PromptLogprob] | None]:
    """Per prompt position: None for the first, else the prompt's token and the k most likely, keyed by token id."""
    result: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        position = {str(t): PromptLogprob(logprob=lp, rank=r, decoded_token=texts(t)) for r, (t, lp) in
                    enumerate(entry.top[:k], start=1)}  # fmt: skip
        position[str(entry.token_id)] = PromptLogprob(
            logprob=entry.logprob, rank=entry.rank, decoded_token=texts(entry.token_id)
        )
        result.append(position)
    return result
