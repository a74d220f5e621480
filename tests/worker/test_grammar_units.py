"""The grammar mask against a reference built from the matchers' own bitmasks, and the compile cache (tiny
tokenizer, CPU)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

import pytest
import torch

from tidal.worker.engine.errors import InvalidGrammarError
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
    assert masks._threads is not None
    # A thread these masks started, asked of it: not every "tidal-masks" thread of the process, which may include
    # those of engines that other tests still hold.
    fill_thread = masks._threads.submit(threading.current_thread).result()
    assert fill_thread.name.startswith("tidal-masks")
    masks.close()
    assert masks._prepared is None
    fill_thread.join(timeout=5)
    assert not fill_thread.is_alive()


@pytest.fixture
def one_thread_compiler(tiny_model):
    """A compiler of one thread, which a test can keep busy (`hold`) to queue compiles behind it."""
    tokenizer = load_tokenizer(tiny_model("llama"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, max_workers=1, max_wait_s=30)
    yield compiler
    compiler.shutdown()


def hold(compiler: GrammarCompiler) -> threading.Event:
    """Occupy the compiler's thread until the returned event is set."""
    release, started = threading.Event(), threading.Event()
    compiler._pool.submit(lambda: (started.set(), release.wait(30)))
    started.wait(5)
    return release


def test_a_client_that_goes_away_leaves_a_shared_compile_alone(one_thread_compiler):
    """Cancelling one waiter (its client disconnected) must not cancel the queued compile that another request
    shares, nor leave a cancelled Future in the cache for the next request of that spec."""
    compiler = one_thread_compiler
    spec = StructuredOutput(kind="regex", text="[a-c]{3}")
    release = hold(compiler)

    async def run():
        gone = asyncio.create_task(compiler.wait(spec))
        staying = asyncio.create_task(compiler.wait(spec))
        await asyncio.sleep(0.05)
        gone.cancel()
        await asyncio.sleep(0.05)
        release.set()
        return await staying

    grammar = asyncio.run(run())
    assert new_matcher(grammar).accept_string("abc")
    assert not compiler.submit(spec).cancelled()


def test_a_request_waits_for_its_grammar_at_most_max_wait_s(one_thread_compiler, monkeypatch):
    """Queued behind a compile that holds the only thread: refused after max_wait_s, saying the compiler is busy.
    A compile that runs past it: refused, saying so; it runs on, and the next request for the spec gets it."""
    compiler = one_thread_compiler
    compiler._max_wait_s = 0.2
    release = hold(compiler)
    with pytest.raises(InvalidGrammarError, match=r"the grammar compiler was busy with other requests for 0\.2 s"):
        asyncio.run(compiler.wait(StructuredOutput(kind="regex", text="x+")))
    release.set()

    slow = StructuredOutput(kind="regex", text="y+")
    compile_once = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda spec: (time.sleep(0.5), compile_once(spec))[1])
    with pytest.raises(InvalidGrammarError, match=r"invalid regex: its compile took longer than 0\.2 s"):
        asyncio.run(compiler.wait(slow))
    compiler._max_wait_s = 30
    assert new_matcher(asyncio.run(compiler.wait(slow))).accept_string("yy")


def test_a_compile_that_fails_after_its_waiter_gave_up_is_not_logged_as_unretrieved(
    one_thread_compiler, monkeypatch, caplog
):
    """The waiter timed out (or its client went away); the compile fails later: its error is the next request's
    to get, not a "Future exception was never retrieved" traceback in the log."""
    compiler = one_thread_compiler
    compiler._max_wait_s = 0.1

    def slow_failure(spec):
        time.sleep(0.3)
        raise InvalidGrammarError("regex", "bad")

    monkeypatch.setattr(compiler, "_compile", slow_failure)

    async def run():
        with pytest.raises(InvalidGrammarError, match=r"took longer than 0\.1 s"):
            await compiler.wait(StructuredOutput(kind="regex", text="z+"))
        await asyncio.sleep(0.5)  # the compile fails meanwhile

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(run())
        compiler._cache.clear()  # the compile's Future (its callbacks hold the waiter's) leaves the cache
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
