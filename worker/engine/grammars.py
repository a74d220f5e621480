"""Compiling structured outputs (engine/structured_output.py) into xgrammar grammars, off the step loop.

Compiling a JSON schema or a grammar against the vocabulary can take from a millisecond to seconds; the step loop
must never wait for it. `submit` runs the compile on a small thread pool and returns a Future; the async engine awaits
it before the request is queued, so a request is admitted with its grammar ready and a grammar that does not compile,
or compiles but can never begin (`can_start`), is refused (a 400 with the engine's message) before it takes any room.
The Futures are kept in an LRU keyed by the spec: equal schemas compile once, and concurrent requests for one schema
share the compile in progress (a failed one stays cached too, so repeating a bad schema costs nothing).

A compile cannot be cancelled (xgrammar has no way to stop one), so what bounds the pool's work is the admission
bound checked on the spec before it is submitted (structured_output.py): schema_cost.py estimates a JSON schema, a
structural tag's schemas, a regex (regex_cost.py) and an EBNF grammar (ebnf_cost.py), and refuses one past its budget
with a 400 that names the costly part. `wait` bounds the client's: past MAX_WAIT_S the request is refused with a 400
while the compile runs on to its end, holding its thread, and is cached for the next request of the same spec. The
deadline is a backstop for what an estimate misjudges and for a pool kept busy by many requests: without it a client
would wait, holding its connection, for as long as the compiles ahead of it take. Compiling in a child process would
bound the work too (it can be killed), at the price of building the tokenizer's xgrammar form there and sending each
compiled grammar back.

xgrammar is imported on first use: a worker that never serves a structured request does not pay for it, nor for
reading the tokenizer's vocabulary into xgrammar's form (about a second at a 150k vocabulary).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from tidal.worker.engine.errors import InvalidGrammarError
from tidal.worker.engine.structured_output import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

# xgrammar's messages start with a time and a C++ source location; the client needs only what follows.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")

# A request's longest wait for its grammar, queueing included: an admitted schema, regex or grammar compiles in well
# under a second (schema_cost.py), so only a pool kept busy by many compiles, or a costly spec the estimate missed,
# reaches it.
MAX_WAIT_S = 10.0


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: set[int],
        max_workers: int = 2,
        cache_size: int = 256,
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache_size = cache_size
        self._max_wait_s = max_wait_s
        self._cache: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="tidal-grammar")
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()

    def submit(self, spec: StructuredOutput) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of `spec`, cached or compiling; its result raises InvalidGrammarError."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():  # cancelled: by shutdown, never compiled
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    async def wait(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec`, awaited for at most `max_wait_s`; raises InvalidGrammarError past it.

        A caller that goes away (its task cancelled) leaves the compile alone: other requests may share its Future,
        which a cancel would otherwise cancel for them all, and leave cancelled in the cache."""
        future = self.submit(spec)
        waited = asyncio.wrap_future(future)
        # A waiter that timed out or went away no longer reads the outcome: one that fails later would be logged
        # as "Future exception was never retrieved", with its traceback.
        waited.add_done_callback(_retrieve_exception)
        try:
            return await asyncio.wait_for(asyncio.shield(waited), self._max_wait_s)
        except TimeoutError:
            kind = spec.kind.replace("_", " ")
            if future.running():
                why = f"its compile took longer than {self._max_wait_s:g} s (a simpler one compiles faster)"
            else:
                why = f"the grammar compiler was busy with other requests for {self._max_wait_s:g} s (try again)"
            raise InvalidGrammarError(kind, why) from None

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """Compile (or find) `spec` and wait for it: for offline use, never on the serving step loop."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        grammar = self._compile_unchecked(spec)
        if not can_start(grammar, self._vocab_size):
            raise InvalidGrammarError(
                spec.kind.replace("_", " "),
                "it matches no string (no token may come first, and the empty output does not match either)",
            )
        return grammar

    def _compile_unchecked(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        try:
            # JSON without free whitespace: exactly ", " and ": " between items (as json.dumps writes by default,
            # xgrammar's separators when any_whitespace is off), nothing else between tokens; a model would otherwise
            # be free to spend its whole budget on blanks between the braces.
            if spec.kind == "json_object":  # any object: the schema of OpenAI's json_object mode
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choices))
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.text)
            return compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidGrammarError(spec.kind.replace("_", " "), _LOCATION.sub("", str(exc)).strip()) from exc

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                # One thread per compile: the pool decides how many run at once.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler


def new_matcher(grammar: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
    """A fresh matcher (one per sample: each advances with its own tokens)."""
    import xgrammar

    return xgrammar.GrammarMatcher(grammar)


def can_start(grammar: xgrammar.CompiledGrammar, vocab_size: int) -> bool:
    """Whether a sample of `grammar` can begin: some token is allowed first, or the grammar is already complete.

    xgrammar compiles grammars whose language is empty (`root ::= root`, left recursion with no base case, a regex
    class that admits no character) without complaint; their first mask allows no token, and sampling from a row
    that is all -inf picks an arbitrary one. One mask fill (tens of microseconds, cached with the compile) finds
    them; it is sound (it refuses only grammars no output can satisfy), not complete: a grammar that dead-ends after
    some tokens passes, and the engine ends such a sample when it gets there (llm_engine.py, `_grammar_end`)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammar)
    if matcher.is_completed():
        return True
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (string literals in JSON's escaping, which the EBNF takes)."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
