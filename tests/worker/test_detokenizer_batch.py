"""A step's detokenization, batched over its sequences (push_each, WindowDecoder), gives exactly the text of the
per-request algorithm it replaced: two `tokenizer.decode` calls per sequence per token. Real tokenizers: the tiny
models' byte-level BPE (multi-byte characters split over byte tokens, special tokens), a WordPiece one whose
decode cleans up spaces, and a tokenizer without a Rust backend."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tidal.worker.engine.detokenizer import IncrementalDetokenizer, WindowDecoder, push_each
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.text_stream import TextStream
from tidal.worker.testing.tiny_tokenizer import EOS, IM_END, build_tokenizer

TEXT = "Tide 🌊 at 5 o'clock: naïve café, 日本語 and Ελληνικά; done. <|im_end|> then more 🙂🙂 text!"


class ReferenceDetokenizer:
    """The per-request algorithm before batching, kept verbatim as the oracle."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - 6)

    def push(self, new_token_ids: list[int]) -> str:
        self._ids.extend(new_token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full == prefix:
            self._advance()
            return ""
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._advance()
        return full[len(prefix) :]

    def _advance(self) -> None:
        self._prefix_offset = max(self._prefix_offset, self._read_offset - 6)
        self._read_offset = len(self._ids)

    def flush(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def streams(tokenizer, num: int, length: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) id lists: real text with multi-byte characters (split over byte tokens by a small
    vocabulary), special tokens, and random ids (which make invalid and incomplete UTF-8)."""
    rng = random.Random(seed)
    text_ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    special = tokenizer.convert_tokens_to_ids([EOS, IM_END])
    out = []
    for _ in range(num):
        start = rng.randrange(len(text_ids))
        ids = (text_ids[start:] + text_ids)[: length + 8]
        for _ in range(length // 6):
            ids[rng.randrange(len(ids))] = rng.choice([*special, rng.randrange(len(tokenizer))])
        out.append((ids[:8], ids[8:]))
    return out


def run_batched(tokenizer, cases, flags: list[bool]) -> list[list[str]]:
    decoder = WindowDecoder(tokenizer)
    dets = [IncrementalDetokenizer(tokenizer, p, f) for (p, _), f in zip(cases, flags, strict=True)]
    deltas: list[list[str]] = [[] for _ in cases]
    for step in range(len(cases[0][1])):
        texts = push_each(decoder, dets, [out[step] for _, out in cases])
        for d, text in zip(deltas, texts, strict=True):
            d.append(text)
    for d, det in zip(deltas, dets, strict=True):
        d.append(det.flush())
    return deltas


def run_reference(tokenizer, cases, flags: list[bool]) -> list[list[str]]:
    deltas = []
    for (prompt, out), flag in zip(cases, flags, strict=True):
        ref = ReferenceDetokenizer(tokenizer, prompt, flag)
        deltas.append([ref.push([t]) for t in out] + [ref.flush()])
    return deltas


@pytest.mark.parametrize("batch", [1, 5, 200])  # 200: both kinds of request past the batched Rust call's threshold
def test_batched_deltas_equal_the_per_request_algorithm(bpe, batch):
    cases = streams(bpe, batch, length=60, seed=batch)
    flags = [i % 3 != 0 for i in range(batch)]  # both kinds of request in one step
    assert WindowDecoder(bpe).is_batched
    got = run_batched(bpe, cases, flags)
    assert got == run_reference(bpe, cases, flags)
    # The test must be able to see the hard cases: some token held back, some special token kept.
    assert any(d == "" for deltas in got for d in deltas[:-1])
    assert any(IM_END in "".join(deltas) for deltas in got)


def test_multibyte_characters_come_out_whole(bpe):
    ids = bpe("日本🌊", add_special_tokens=False)["input_ids"]
    assert len(ids) > 3  # the small vocabulary splits them into byte tokens
    det = IncrementalDetokenizer(bpe, [], skip_special_tokens=True)
    deltas = [push_each(WindowDecoder(bpe), [det], [t])[0] for t in ids]
    assert "".join(deltas) == "日本🌊"
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete


def test_window_decoder_equals_decode_with_clean_up():
    """WordPiece decoding with clean_up_tokenization_spaces: the Rust text alone would differ (" ," vs ",")."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "[SEP]", "hello", "world", ",", ".", "it", "'", "s", "##s", "n't"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )
    rng = random.Random(0)
    windows = [[rng.randrange(len(vocab)) for _ in range(rng.randrange(1, 9))] for _ in range(100)]
    decoder = WindowDecoder(tokenizer)
    assert decoder.is_batched
    for skip in (True, False):
        expected = [tokenizer.decode(w, skip_special_tokens=skip) for w in windows]
        assert decoder.decode(windows, skip) == expected
        assert expected != backend.decode_batch(windows, skip_special_tokens=skip)  # the clean-up mattered


class SlowCharTokenizer:
    """No Rust backend: id -> chr(id), special id 0 dropped when asked."""

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(chr(i) for i in ids if i or not skip_special_tokens)


def test_slow_tokenizer_falls_back_to_its_own_decode():
    tokenizer = SlowCharTokenizer()
    decoder = WindowDecoder(tokenizer)  # type: ignore[arg-type]
    assert not decoder.is_batched
    rng = random.Random(1)
    cases = [([65, 66], [rng.choice([0, *range(97, 110)]) for _ in range(30)]) for _ in range(4)]
    flags = [True, False, True, False]
    assert run_batched(tokenizer, cases, flags) == run_reference(tokenizer, cases, flags)


def test_stop_strings_across_token_boundaries_match_the_per_request_stream(bpe):
    ids = bpe(TEXT, add_special_tokens=False)["input_ids"]
    for stop in ["café, 日", "e 🌊 a", "Ελ", "done. <|im_end|>"]:
        params = SamplingParams(stop=[stop], skip_special_tokens=False)
        ref = TextStream(ReferenceDetokenizer(bpe, [], False), params)  # type: ignore[arg-type]
        det = IncrementalDetokenizer(bpe, [], False)
        batched = TextStream(det, params)
        decoder = WindowDecoder(bpe)
        ref_deltas, got_deltas = [], []
        for token in ids:
            ref_deltas.append(ref.push([token]))
            got_deltas.append(batched.add_text(push_each(decoder, [det], [token])[0]))
            assert batched.stopped == ref.stopped
            if ref.stopped:
                break
        assert ref.stopped, stop
        assert got_deltas == ref_deltas
        assert "".join(got_deltas) == TEXT[: TEXT.index(stop)]
