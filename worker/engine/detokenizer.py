"""Incremental detokenization: the text each new token adds, without re-decoding the whole output.

Decoding a token alone is wrong for many tokenizers (a leading-space marker, a UTF-8 character split over
byte tokens), so each step decodes a short window of recent tokens twice, with and without the new ones,
and emits the difference; while the window ends in an incomplete character, nothing is emitted yet.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens of context kept before the unread ones; enough for any tokenizer's merge of a leading space.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._read_offset = len(self._ids)  # tokens before this are already in the emitted text
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)

    def push(self, new_token_ids: list[int]) -> str:
        """-> the text the new tokens add ("" while a character is still incomplete)."""
        self._ids.extend(new_token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full == prefix:
            # The new tokens add nothing (skipped special tokens, ids the tokenizer lacks): read them anyway, or a
            # long run of them would make every later push decode an ever longer window. They stay in the window's
            # context, so text they only make together with later tokens still comes out.
            self._advance()
            return ""
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._advance()
        return full[len(prefix) :]

    def _advance(self) -> None:
        self._prefix_offset = max(self._prefix_offset, self._read_offset - _CONTEXT_TOKENS)
        self._read_offset = len(self._ids)

    def flush(self) -> str:
        """-> text still held back because it ends in an incomplete character (the request is ending)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
