"""How few tokens a text can encode to, found without encoding it: a floor that lets the server refuse a text too
long for the context before spending seconds tokenizing it.

Tokenizing takes about 1.5 s per megabyte on one of the prompt builder's threads, and a body may carry 8 MiB of
text: such a prompt was refused (context_length_exceeded) only after that, while the threads it held kept every
other request waiting. If no token stands for more than B bytes of the text, a text of N bytes needs at least
ceil(N / B) tokens, and one whose floor is over the limit is refused at once.

B is counted on the tokenizer's pieces, not on their decoded text: a piece is what the model matched, while a lone
token's decoding drops a leading space (Metaspace and Strip decoders) or turns a partial UTF-8 sequence into U+FFFD,
so it can be shorter than what the token stood for; decoding a 150k vocabulary one token at a time is also ten times
slower than listing it. The floor holds only where every byte of the text ends up in some token, each standing for
at most B bytes: `token_floor` checks the pipeline's stages for that and gives None (count by tokenizing, as before)
for any that could drop text or fold a run of it into one token.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

# Pre-tokenizers that split the text or rewrite its spaces, never dropping any of it. Whitespace, WhitespaceSplit,
# BertPreTokenizer, CharDelimiterSplit and a "removed" Split drop what they split on: 8 MB of spaces would be no token.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Punctuation", "Digits", "UnicodeScripts"})
# Normalizers whose output, over the whole text, is no longer than over the pieces between added tokens (which the
# tokenizer normalizes one by one, and the floor does not): maps of one character, compositions (a cut between
# pieces can only prevent one), and a prefix (each piece gets its own). Strip would strip every piece; Precompiled
# and regex replacements can match across a cut.
_PIECEWISE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace"})
# Of those, the ones that never shorten the text: with only these, the text's own length is the floor's measure and
# normalizing it (0.4 s for 8 MB under NFC) is skipped.
_NEVER_SHORTER = frozenset({"Prepend", "Replace"})
# The bytes valid UTF-8 may hold (never C0, C1, F5-FF), and the pieces that stand for them: byte fallback's
# "<0x0A>", and a byte-level BPE's characters (GPT-2's map: printable Latin-1 as itself, the rest from U+0100 on).
# A vocabulary without one of them makes that byte unknown: SmolLM2's GGUF lacks \x04, and 3000 of them were one
# "<|endoftext|>".
_UTF8_BYTES = [byte for byte in range(256) if byte not in (0xC0, 0xC1) and byte < 0xF5]
_BYTE_PIECES = [f"<0x{byte:02X}>" for byte in _UTF8_BYTES]
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_BYTE_LEVEL = {byte: chr(byte) for byte in _PRINTABLE} | {
    byte: chr(0x100 + index) for index, byte in enumerate(b for b in range(256) if b not in _PRINTABLE)
}
_BYTE_LEVEL_PIECES = [_BYTE_LEVEL[byte] for byte in _UTF8_BYTES]
# A character outside the vocabulary, without byte fallback, is one unknown token; UTF-8 spends at most 4 bytes on it.
_MAX_CHAR_BYTES = 4


@dataclass(frozen=True)
class TokenFloor:
    """At most `max_bytes_per_token` bytes of the (normalized) text stand behind each token."""

    max_bytes_per_token: int
    # The tokenizer's normalizer, where it may shorten the text: the tokens cover its output, not the input.
    normalize: Callable[[str], str] | None = None

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` can encode to (valid Unicode: `prompts.unicode_text` checks it first)."""
        if self.normalize is not None:
            text = self.normalize(text)
        return -(-len(text.encode("utf-8")) // self.max_bytes_per_token)


def token_floor(tokenizer: object) -> TokenFloor | None:
    """The floor of a Hugging Face fast tokenizer whose pipeline keeps every byte of the text; None for any other
    (logged with the reason). A pass over the vocabulary: about 25 ms for 50k tokens, once per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        log.info("no early refusal of long prompts: %s is not a fast tokenizer", type(tokenizer).__name__)
        return None
    pre_tokenizer = _state(backend.pre_tokenizer)
    normalizer = _state(backend.normalizer)
    reason = _lossy_stage(backend, pre_tokenizer, normalizer)
    if reason is not None:
        log.info("no early refusal of long prompts: the tokenizer %s", reason)
        return None
    shortens = any(step["type"] not in _NEVER_SHORTER for step in _steps(normalizer, "normalizers"))
    normalize = backend.normalizer.normalize_str if shortens and backend.normalizer is not None else None
    pieces = backend.get_vocab(with_added_tokens=False)
    if any(step["type"] == "ByteLevel" for step in _steps(pre_tokenizer, "pretokenizers")):
        # The model sees one character per byte of the text: a piece of k characters stands for k bytes. (A byte
        # fallback piece, "<0x0A>", stands for one, and is longer.)
        longest_piece = max(map(len, pieces), default=1)
    else:
        # A piece is text as the model saw it, or longer: "▁" (3 bytes) may stand for a space, "<0x0A>" for a byte.
        longest_piece = max((len(p.encode("utf-8")) for p in pieces), default=1)
    # An added token matches its content in the text, or in the normalized text; the floor measures the latter.
    longest_added = max(
        (
            max(len(t.content.encode("utf-8")), len(_normalized(backend, t.content).encode("utf-8")))
            for t in backend.get_added_tokens_decoder().values()
        ),
        default=1,
    )
    floor = TokenFloor(max(longest_piece, longest_added, _MAX_CHAR_BYTES), normalize)
    log.info(
        "long prompts are refused before tokenizing: a token stands for at most %d bytes", floor.max_bytes_per_token
    )
    return floor


def _lossy_stage(backend: Tokenizer, pre_tokenizer: dict[str, Any], normalizer: dict[str, Any]) -> str | None:
    """Why this pipeline may turn many bytes of text into few tokens (beyond B each), or None when it cannot."""
    if backend.truncation is not None:
        return "truncates its output"
    model = backend.model
    byte_level = any(step["type"] == "ByteLevel" for step in _steps(pre_tokenizer, "pretokenizers"))
    if isinstance(model, models.BPE):
        reason = _bpe_unknowns(model, byte_level)
        if reason is not None:
            return reason
    elif isinstance(model, models.Unigram):
        # The binding does not expose the flag; the model's state has it (and its vocabulary: read only here).
        if not json.loads(model.__getstate__()).get("byte_fallback", False):
            return "fuses a run of unknown characters into one token (Unigram without byte fallback)"
        if not _has_all(model, _BYTE_PIECES):  # a byte without its piece makes the character unknown
            return "fuses a run of unknown characters into one token (Unigram without every byte's piece)"
    else:  # WordPiece: a word past its length limit is one [UNK]; WordLevel: any unknown word is
        return f"has a {type(model).__name__} model, which may stand one token for a whole word"
    for step in _steps(pre_tokenizer, "pretokenizers"):
        if step["type"] not in _KEEPING_PRE_TOKENIZERS or str(step.get("behavior", "")).lower() == "removed":
            return f"pre-tokenizes with {step['type']}, which may drop text"
    for step in _steps(normalizer, "normalizers"):
        if step["type"] not in _PIECEWISE_NORMALIZERS:
            return f"normalizes with {step['type']}"
        if step["type"] == "Replace" and not _one_char_replace(step):
            return "normalizes with a Replace of more than one character, or one that shortens the text"
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip:
            return f"has the added token {token.content!r}, which takes in the whitespace beside it"
    return None


def _bpe_unknowns(model: models.BPE, byte_level: bool) -> str | None:
    """Why a character outside this BPE's vocabulary may not be one token of its own, or None when it is."""
    if byte_level and _has_all(model, _BYTE_LEVEL_PIECES):
        return None  # every byte of the text is a character in the vocabulary: none is unknown
    if model.byte_fallback and _has_all(model, _BYTE_PIECES):
        return None  # an unknown character is its bytes' pieces
    # Byte fallback without every byte's piece goes on to the unknown token; without one the character is
    # dropped (4000 CJK characters were 4 tokens).
    if not model.unk_token:
        return "drops characters outside its vocabulary (no unknown token, no byte fallback to every byte)"
    if model.fuse_unk:
        return "fuses a run of unknown characters into one token"
    return None


def _has_all(model: models.Model, pieces: list[str]) -> bool:
    return all(model.token_to_id(piece) is not None for piece in pieces)


def _one_char_replace(step: dict[str, Any]) -> bool:
    """A Replace of one literal character by at least as many bytes: it cannot match across a cut between pieces,
    and never shortens the text (Llama's and Gemma's " " -> "▁")."""
    pattern = step.get("pattern", {}).get("String")
    content = step.get("content", "")
    return isinstance(pattern, str) and len(pattern) == 1 and len(content.encode()) >= len(pattern.encode())


def _normalized(backend: Tokenizer, text: str) -> str:
    return backend.normalizer.normalize_str(text) if backend.normalizer is not None else text


def _state(component: normalizers.Normalizer | pre_tokenizers.PreTokenizer | None) -> dict[str, Any]:
    """A pipeline stage as its JSON (None: an empty Sequence)."""
    if component is None:
        return {"type": "Sequence"}
    state = json.loads(component.__getstate__())
    return state if isinstance(state, dict) else {"type": "Sequence"}


def _steps(state: dict[str, Any], members: str) -> list[dict[str, Any]]:
    """The stage's steps, Sequences flattened."""
    if state.get("type") != "Sequence":
        return [state]
    return [step for member in state.get(members, []) for step in _steps(member, members)]
