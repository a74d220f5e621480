"""Incremental detokenization: the text each new token adds, without re-decoding the whole output.

Decoding a token alone is wrong for many tokenizers (a leading-space marker, a UTF-8 character split over
byte tokens), so each step decodes a short window of recent tokens twice, with and without the new ones,
and emits the difference; while the window ends in an incomplete character, nothing is emitted yet.

A step decodes the windows of all its sequences together (`push_each`), straight through a fast tokenizer's
Rust backend (one `decode_batch` call for a large step) rather than through `tokenizer.decode`, whose Python
layers cost more than the decoding; the text is the same (WindowDecoder applies what that layer would).
"""

from __future__ import annotations

from typing import cast

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Tokens of context kept before the unread ones; enough for any tokenizer's merge of a leading space.
_CONTEXT_TOKENS = 6
# Fewer windows than this are decoded one by one (still in Rust): decode_batch spreads the windows over a thread
# pool, which pays off only for large steps (measured on an H200 host: faster from 256 sequences, slower at 32).
_MIN_BATCH = 128


class WindowDecoder:
    """Decodes many id lists at once into exactly what `tokenizer.decode(ids, skip_special_tokens=...)` gives."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._backend = _rust_backend(tokenizer)
        self._clean_up = self._backend is not None and _cleans_up(tokenizer, self._backend)

    @property
    def is_batched(self) -> bool:
        return self._backend is not None

    def decode(self, windows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        if self._backend is None:  # a slow (Python) tokenizer: its own decode, one window at a time
            return [_decode_ids(self._tokenizer, w, skip_special_tokens) for w in windows]
        if len(windows) < _MIN_BATCH:
            texts = [self._backend.decode(w, skip_special_tokens=skip_special_tokens) for w in windows]
        else:
            texts = self._backend.decode_batch(windows, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            return [self._tokenizer.clean_up_tokenization(t) for t in texts]
        return texts


def _rust_backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer behind `tokenizer`, when its decode is the plain fast-tokenizer one (a subclass that
    changes decoding keeps its own, called per window)."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if cls._decode is not PreTrainedTokenizerFast._decode or cls.decode is not PreTrainedTokenizerBase.decode:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _cleans_up(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> bool:
    """Whether the fast tokenizer's decode runs clean_up_tokenization on the Rust text (it never does for BPE
    unless forced, as that would strip real spaces)."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or bool(forced)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._read_offset = len(self._ids)  # tokens before this are already in the emitted text
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)

    def push(self, new_token_ids: list[int]) -> str:
        """-> the text the new tokens add ("" while a character is still incomplete)."""
        self.append(new_token_ids)
        prefix, full = self.windows()
        return self.take(self._decode(prefix), self._decode(full))

    def append(self, new_token_ids: list[int]) -> None:
        """Add unread tokens (their text comes out of the next `take`)."""
        self._ids.extend(new_token_ids)

    def windows(self) -> tuple[list[int], list[int]]:
        """-> (the context already read, the context plus the unread tokens): the two id lists to decode."""
        return self._ids[self._prefix_offset : self._read_offset], self._ids[self._prefix_offset :]

    def take(self, prefix: str, full: str) -> str:
        """Given the decoded `windows()`, -> the text the unread tokens add, and mark them read when it is out."""
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
        prefix, full = self.windows()
        prefix_text, full_text = self._decode(prefix), self._decode(full)
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return _decode_ids(self._tokenizer, ids, self.skip_special_tokens)


def _decode_ids(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool) -> str:
    # One id list decodes to one str; decode's annotation also covers a batch of lists (-> list[str]).
    return cast(str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def push_each(
    decoder: WindowDecoder, detokenizers: list[IncrementalDetokenizer], new_token_ids: list[int]
) -> list[str]:
    """Give detokenizer i the token new_token_ids[i]; -> the text each adds, as `push([token])` on each would."""
    windows: list[list[int]] = []
    add_window = windows.append
    for det, token in zip(detokenizers, new_token_ids, strict=True):
        ids = det._ids
        ids.append(token)
        start = det._prefix_offset
        add_window(ids[start : det._read_offset])
        add_window(ids[start:])
    flag = detokenizers[0].skip_special_tokens if detokenizers else True
    if all(det.skip_special_tokens == flag for det in detokenizers):  # the usual case: one kind of request
        texts = decoder.decode(windows, flag)
    else:
        texts = [""] * len(windows)
        for skip in (True, False):
            rows = [i for i, det in enumerate(detokenizers) if det.skip_special_tokens == skip]
            decoded = decoder.decode([w for i in rows for w in windows[2 * i : 2 * i + 2]], skip)
            for k, i in enumerate(rows):
                texts[2 * i], texts[2 * i + 1] = decoded[2 * k], decoded[2 * k + 1]
    return [det.take(prefix, full) for det, prefix, full in zip(detokenizers, texts[0::2], texts[1::2], strict=True)]
