"""A vocabulary of the model's full size for the engine's grammar compiler, when the benchmark's tokenizer is smaller.

The presets ship the tiny tokenizer (512 tokens) whatever the model's vocabulary (128256 for the 8B shape). The
engine's own compiler would read that tokenizer into xgrammar and treat every id past it as one no grammar allows:
a structured row's mask would then be computed over 512 tokens instead of 128k, which makes masks far cheaper than
with a real tokenizer, and leaves the random model choosing among 512 of its logits. So the benchmark hands the
engine a compiler over a made-up vocabulary of the model's size: the tokenizer's own tokens first (as the engine
would decode them), then seeded strings shaped like a byte-level BPE vocabulary's (word pieces with and without a
leading space, numbers, runs of punctuation with quotes and brackets, some multi-byte characters). Tokens that hold
a quote, a backslash or a bracket are the ones whose fate inside a JSON string depends on the matcher's state, the
costly part of a mask, and the vocabulary holds a few thousand of them, as real ones do.

The detokenizer keeps the tiny tokenizer (ids past it decode to nothing), which matters to no figure here: the
grammar follows token ids, and every run's length is set by max_tokens.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from tidal.worker.engine.grammars import GrammarCompiler
from tidal.worker.engine.llm_engine import LLMEngine

if TYPE_CHECKING:
    import xgrammar

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PUNCTUATION = "{}[]\",:.;!?()-_'/\\ \n"


def require_xgrammar() -> None:
    """Fail at once, with what to do, on a machine without xgrammar (structured outputs need it)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            "sampling_perf: xgrammar is not installed, and the structured-output run needs it "
            "(pip install 'xgrammar>=0.2.9', the version pyproject.toml names)"
        ) from exc


def synthetic_tokens(count: int, seed: int, taken: list[bytes] | None = None) -> list[bytes]:
    """`count` distinct token strings (UTF-8) none of which is in `taken`, the same for a given seed."""
    rng = random.Random(seed)
    seen: set[bytes] = set(taken or [])
    tokens: list[bytes] = []
    while len(tokens) < count:
        kind = rng.random()
        if kind < 0.85:  # word pieces, half of them starting a word
            text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 10)))
            text = text.capitalize() if rng.random() < 0.3 else text
            text = " " + text if rng.random() < 0.5 else text
        elif kind < 0.90:
            text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        elif kind < 0.97:
            text = "".join(rng.choice(PUNCTUATION) for _ in range(rng.randint(2, 4)))
        else:
            text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 2)))
        token = text.encode()
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    return tokens


class FullVocabularyGrammars(GrammarCompiler):
    """The engine's grammar compiler (same thread pool, cache and compile options), over the tokenizer's tokens
    followed by synthetic ones up to `vocab_size`."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        super().__init__(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
        self._engine = engine
        self._seed = seed
        self.num_synthetic_tokens = 0

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                engine = self._engine
                own = xgrammar.TokenizerInfo.from_huggingface(
                    engine.tokenizer, vocab_size=len(engine.tokenizer), stop_token_ids=sorted(engine.eos_token_ids)
                ).decoded_vocab  # the bytes each of the tokenizer's ids stands for
                extra = synthetic_tokens(max(0, engine.vocab_size - len(own)), self._seed, own)
                self.num_synthetic_tokens = len(extra)
                info = xgrammar.TokenizerInfo(
                    [*own, *extra][: engine.vocab_size],
                    xgrammar.VocabType.RAW,
                    vocab_size=engine.vocab_size,
                    stop_token_ids=sorted(engine.eos_token_ids),
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler


def install(engine: LLMEngine, seed: int = 0) -> FullVocabularyGrammars:
    """Give `engine` a compiler over a vocabulary of its model's size (before any structured request arrives)."""
    grammars = FullVocabularyGrammars(engine, seed)
    engine.grammars.shutdown()
    engine.grammars = grammars
    return grammars
