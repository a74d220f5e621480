"""The token floor (worker/server/token_floor.py) and the prompt limit it is checked against: the floor is never
above the real count, on texts built to put the most text in each token, for each kind of pipeline it accepts; a
pipeline that can fold text away gets no floor; and the limit names whose it is as the server always has."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tidal.worker.server.errors import ApiError
from tidal.worker.server.prompt_limit import PromptLimit
from tidal.worker.server.token_floor import TokenFloor, token_floor
from tidal.worker.testing.tiny_tokenizer import TRAINING_TEXT, build_tokenizer

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
PROSE = " ".join(TRAINING_TEXT)
# Each built to get many bytes into few tokens, or to be shortened by a normalizer.
TEXTS = [
    "",
    "a",
    PROSE * 3,
    " " * 5000,
    "\n" + " " * 4000,
    "A" * 6400,
    "\U0001d400" * 1600,  # MATHEMATICAL BOLD CAPITAL A: 4 bytes, "A" under NFKC
    "e\u0301" * 2000,  # composes to "é" (3 bytes -> 2) under NFC
    "\u212a" * 1000,  # KELVIN SIGN: 3 bytes, "k" (1) lowercased
    "漢字" * 1000,
    "🙂" * 800,
    "<|im_start|>" * 500,
    "<|im_start|> " * 500,
    "\x00\x01\x7f" * 1000,
]


def _byte_level_bpe(normalizer: normalizers.Normalizer | None = None, extra: list[str] | None = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4 + (extra or []) * 50, trainer)
    return tokenizer


def _sentencepiece_bpe(metaspace: bool) -> Tokenizer:
    """Llama 2's layout (spaces made "▁" by the normalizer) or Mistral's (by a Metaspace pre-tokenizer); unknown
    characters fall back to their bytes."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if metaspace:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    else:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<unk>", "<|im_start|>", *BYTE_TOKENS], show_progress=False
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4 + ["    " * 8], trainer)
    return tokenizer


def _unigram() -> Tokenizer:
    pieces = [("<unk>", 0.0), *((b, -20.0) for b in BYTE_TOKENS), ("▁", -2.0), ("▁▁▁▁▁▁▁▁", -1.0)]
    pieces += [(c, -5.0) for c in sorted(set(PROSE) - {" "})] + [("▁the▁tide▁comes▁in", -1.0)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    return tokenizer


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize(
    "tokenizer",
    [
        _byte_level_bpe(),
        _byte_level_bpe(normalizers.NFC()),
        _byte_level_bpe(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), ["A" * 64, "k" * 64]),
        _sentencepiece_bpe(metaspace=False),
        _sentencepiece_bpe(metaspace=True),
        _unigram(),
    ],
    ids=["byte-level", "byte-level-nfc", "byte-level-nfkc-lower", "llama2-spm", "mistral-spm", "unigram"],
)
def test_the_floor_is_never_above_the_real_count(tokenizer):
    floor = token_floor(PreTrainedTokenizerFast(tokenizer_object=tokenizer))
    assert floor is not None
    for text in TEXTS:
        assert floor.min_tokens(text) <= _count(tokenizer, text), (text[:20], floor)


def test_a_normalizer_that_shortens_the_text_is_measured_after_it():
    # Trained on runs of "A": 6400 of them are 100 tokens of 64 bytes. The same run of 4-byte bold A's that NFKC
    # turns into them is 25600 bytes as sent: measured as sent, its floor would be 400, above the real count.
    tokenizer = _byte_level_bpe(normalizers.NFKC(), ["A" * 64])
    floor = token_floor(PreTrainedTokenizerFast(tokenizer_object=tokenizer))
    assert floor is not None and floor.normalize is not None and floor.max_bytes_per_token == 64
    assert _count(tokenizer, "\U0001d400" * 6400) == 100 == floor.min_tokens("\U0001d400" * 6400)


def test_the_tiny_tokenizers_floor():
    floor = token_floor(build_tokenizer())
    # The longest piece: "<|begin_of_text|>". No normalizer, so nothing is normalized per request.
    assert floor == TokenFloor(17, None)
    assert floor.min_tokens("x" * 8_000_000) == 470_589


def _with(tokenizer: Tokenizer, **stages: object) -> Tokenizer:
    for name, stage in stages.items():
        setattr(tokenizer, name, stage)
    return tokenizer


def _lstrip_token() -> Tokenizer:
    tokenizer = _byte_level_bpe()
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # " " * 5000 + "<mask>" is one token
    return tokenizer


def _truncating() -> Tokenizer:
    tokenizer = _byte_level_bpe()
    tokenizer.enable_truncation(16)
    return tokenizer


@pytest.mark.parametrize(
    "tokenizer",
    [
        Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),  # a long word is one [UNK]
        Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")),
        Tokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True)),  # a run of unknowns: one
        Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0)),  # fuses unknowns, no byte fallback
        _with(_byte_level_bpe(), pre_tokenizer=pre_tokenizers.Whitespace()),  # drops the spaces
        _with(_byte_level_bpe(), pre_tokenizer=pre_tokenizers.Split(" ", "removed")),
        _with(_byte_level_bpe(), normalizer=normalizers.Strip()),
        _with(_byte_level_bpe(), normalizer=normalizers.StripAccents()),
        _with(_byte_level_bpe(), normalizer=normalizers.Replace(Regex(" +"), " ")),
        _with(_byte_level_bpe(), normalizer=normalizers.Replace("ab", "c")),
        _lstrip_token(),
        _truncating(),
    ],
    ids=[
        "wordpiece", "wordlevel", "bpe-fusing-unk", "unigram-fusing-unk", "whitespace", "split-removed", "strip",
        "strip-accents", "regex-replace", "long-replace", "lstrip-token", "truncation",
    ],
)  # fmt: skip
def test_a_pipeline_that_can_fold_text_away_has_no_floor(tokenizer):
    assert token_floor(PreTrainedTokenizerFast(tokenizer_object=tokenizer)) is None


def _trained_bpe(model: models.BPE, special_tokens: list[str], alphabet: list[str] | None = None) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace() if alphabet is None else pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special_tokens, initial_alphabet=alphabet or [], show_progress=False
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    return tokenizer


@pytest.mark.parametrize(
    "tokenizer",
    [
        _trained_bpe(models.BPE(), ["<s>"]),  # no unknown token, no byte fallback
        _trained_bpe(models.BPE(byte_fallback=True), ["<s>"]),  # byte fallback, but no byte pieces
        _trained_bpe(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True), ["<unk>"]),  # the run fuses
        _trained_bpe(models.BPE(byte_fallback=True), ["<s>", *BYTE_TOKENS[:128]]),  # half of the byte pieces
        _trained_bpe(models.BPE(), ["<s>"], alphabet=[]),  # byte level, but only the training text's bytes
    ],
    ids=["no-unk", "fallback-without-bytes", "fallback-without-bytes-fusing-unk", "half-the-bytes", "byte-level-gaps"],
)
def test_a_bpe_that_drops_or_fuses_unknown_characters_has_no_floor(tokenizer):
    """4000 CJK characters outside the vocabulary encoded to 4-5 tokens where the floor said 1201."""
    text = "hello " + "漢" * 4000
    assert _count(tokenizer, text) < 10  # what the floor would have been unsound for
    assert token_floor(PreTrainedTokenizerFast(tokenizer_object=tokenizer)) is None


def test_a_bpe_with_an_unfused_unknown_token_keeps_its_floor():
    tokenizer = _trained_bpe(models.BPE(unk_token="<unk>", fuse_unk=False), ["<unk>"])
    floor = token_floor(PreTrainedTokenizerFast(tokenizer_object=tokenizer))
    assert floor is not None
    for text in [*TEXTS, "hello " + "漢" * 4000]:
        assert floor.min_tokens(text) <= _count(tokenizer, text), (text[:20], floor)


def test_a_tokenizer_without_a_fast_backend_has_no_floor():
    assert token_floor(object()) is None


def test_the_limit_is_the_smaller_one_named_as_before():
    assert PromptLimit.of(256, None) == PromptLimit(
        255, "this model accepts at most 255 (max_model_len is 256, and at least one token must be generated)"
    )
    assert PromptLimit.of(256, 32) == PromptLimit(32, "this worker accepts at most 32 (max_prompt_tokens)")
    assert PromptLimit.of(256, 255).whose.endswith("(max_prompt_tokens)")
    assert PromptLimit.of(256, 1000).max_tokens == 255


def test_a_text_over_the_limit_by_its_floor_is_refused_in_the_usual_shape():
    limit = PromptLimit.of(256, 32)
    floor = TokenFloor(10)
    limit.check_text(floor, "x" * 320, "prompt")  # a floor of 32: it may fit
    limit.check_text(None, "x" * 10_000, "prompt")  # no floor: counted by tokenizing, as before
    with pytest.raises(ApiError) as refused:
        limit.check_text(floor, "x" * 321, "messages")
    error = refused.value
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert error.message == "the prompt has at least 33 tokens but this worker accepts at most 32 (max_prompt_tokens)"
