"""The grammar mask against a reference built from the matchers' own bitmasks, and the compile cache (tiny
tokenizer, CPU)."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal.worker.engine.grammar_masks import GrammarMasks
from tidal.worker.engine.grammars import GrammarCompiler, new_matcher
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.structured_output import StructuredOutput
from tidal.worker.loader.model_loader import load_tokenizer

VOCAB_PADDING = 7  # models often have more logits than the tokenizer has tokens


@pytest.fixture(scope="module")
def compiler(tiny_model) -> GrammarCompiler:
    tokenizer = load_tokenizer(tiny_model("llama"))
    return GrammarCompiler(tokenizer, len(tokenizer) + VOCAB_PADDING, {tokenizer.eos_token_id}, cache_size=3)


def allowed_ids(matcher, vocab: int) -> set[int]:
    """The reference: the ids whose bit the matcher sets, read one by one."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def test_only_the_structured_rows_are_masked_exactly(compiler):
    vocab = compiler._vocab_size
    grammar = compiler.compile(StructuredOutput(kind="regex", text=r"(ab|cd)[0-9]+"))
    advanced = new_matcher(grammar)
    assert advanced.accept_string("ab")
    matchers = [None, new_matcher(grammar), None, advanced, None]
    logits = torch.randn(len(matchers), vocab, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    batch = SampleBatch([SamplingParams()] * len(matchers), list(range(len(matchers))), matchers=matchers)
    GrammarMasks(torch.device("cpu")).apply(masked, batch)
    for row, matcher in enumerate(matchers):
        if matcher is None:
            assert torch.equal(masked[row], logits[row])  # bit for bit
            continue
        allowed = allowed_ids(matcher, vocab)
        assert allowed and max(allowed) < vocab - VOCAB_PADDING  # padding ids are never tokens
        finite = {t for t in range(vocab) if torch.isfinite(masked[row, t])}
        assert finite == allowed
        assert torch.equal(masked[row, sorted(allowed)], logits[row, sorted(allowed)])


def masked_by(masks: GrammarMasks, matchers: list, vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(matchers), vocab)
    masks.apply(logits, SampleBatch([SamplingParams()] * len(matchers), list(range(len(matchers))), matchers=matchers))
    return torch.isfinite(logits)


def test_prepared_masks_are_used_only_for_the_rows_they_were_made_for(compiler):
    vocab = compiler._vocab_size
    grammar = compiler.compile(StructuredOutput(kind="regex", text=r"(ab|cd)[0-9]+"))
    first, second, third = new_matcher(grammar), new_matcher(grammar), new_matcher(grammar)
    assert second.accept_string("ab")
    assert third.accept_string("cd1")
    want = masked_by(GrammarMasks(torch.device("cpu")), [first, second, third], vocab)

    masks = GrammarMasks(torch.device("cpu"))
    masks.prepare([first, None, second, third], vocab)
    assert torch.equal(masked_by(masks, [first, second, third], vocab), want)  # the same rows: as filled now

    masks.prepare([first, second, third], vocab)
    assert torch.equal(masked_by(masks, [first, None, third], vocab)[[0, 2]], want[[0, 2]])  # a row ended since

    masks.prepare([first], vocab)
    assert torch.equal(masked_by(masks, [third], vocab), want[2:])  # not the prepared rows: filled now
    assert masks._prepared is None


def test_equal_specs_share_one_compile_and_the_cache_is_bounded(compiler):
    specs = [StructuredOutput.choice([f"x{i}"]) for i in range(4)]
    first = compiler.submit(specs[0])
    assert compiler.submit(StructuredOutput.choice(["x0"])) is first
    for spec in specs[1:]:
        compiler.submit(spec).result()
    assert compiler.submit(specs[0]) is not first  # the least recently used entry was dropped
    assert compiler.submit(specs[3]).result() is compiler.submit(specs[3]).result()


def test_choice_grammar_escapes_its_strings(compiler):
    strange = ['say "hi"', "back\\slash", "two\nlines\ttab"]
    grammar = compiler.compile(StructuredOutput.choice(strange))
    for text in strange:
        matcher = new_matcher(grammar)
        assert matcher.accept_string(text) and matcher.is_completed()


def test_close_ends_the_fill_thread(compiler):
    """The engine's shutdown closes the masks: a prepared fill is dropped and its thread ends (it is not left
    running until the interpreter exits)."""
    grammar = compiler.compile(StructuredOutput(kind="regex", text=r"(ab|cd)[0-9]+"))
    masks = GrammarMasks(torch.device("cpu"))
    masks.prepare([new_matcher(grammar)], compiler._vocab_size)
    assert masks._thread is not None
    # The one thread these masks started, asked of it: not every "tidal-masks" thread of the process, which may
    # include those of engines that other tests still hold.
    fill_thread = masks._thread.submit(threading.current_thread).result()
    assert fill_thread.name.startswith("tidal-masks")
    masks.close()
    assert masks._prepared is None
    fill_thread.join(timeout=5)
    assert not fill_thread.is_alive()
