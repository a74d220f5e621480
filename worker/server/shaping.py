"""What each choice carries besides its text, as the request asked: logprobs, the echoed prompt, prompt logprobs,
token ids; the same for a whole response and for a streamed chunk (a choice's first chunk carries what is said once:
the echoed prompt, its logprobs, its token ids; chat's prompt logprobs and ids are the response's, each role chunk's
when streamed).

`max_tokens: 0` with echo scores the prompt alone: the engine generates one token (it always samples after a
prefill), which the choice leaves out, with finish_reason "length" and no completion tokens in the usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.worker.engine.outputs import RequestOutput, TokenLogprob
from tidal.worker.server.choices import Collected
from tidal.worker.server.generation import Generation
from tidal.worker.server.protocol import ChatCompletionRequest, CompletionRequest
from tidal.worker.server.responses import (
    AssistantMessage,
    CalledFunction,
    ChatLogprobs,
    CompletionChoice,
    FunctionDelta,
    PromptLogprobs,
    ToolCallDelta,
    ToolCallOut,
)
from tidal.worker.server.token_info import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs
from tidal.worker.server.tool_calls.calls import ToolCall
from tidal.worker.server.tool_calls.format import ToolCallFormat, parse_output
from tidal.worker.server.tool_calls.stream import StreamDelta, ToolCallStream


@dataclass
class CompletionShape:
    request: CompletionRequest
    prompt_texts: list[str]  # by prompt, for echo
    texts: TokenTexts

    def __post_init__(self) -> None:
        self._offsets: dict[int, int] = {}  # streamed: choice -> text offset of its next token

    @property
    def scores_only(self) -> bool:
        """max_tokens 0: the generated token is left out."""
        return self.request.max_tokens == 0

    @property
    def is_plain(self) -> bool:
        """Streamed chunks carry a choice's text and finish reason alone (sse_chunks.py writes them)."""
        r = self.request
        plain = r.logprobs is None and r.prompt_logprobs is None and not r.echo and not r.return_token_ids
        return plain and not self.scores_only

    def whole(self, index: int, generation: Generation, collected: Collected, finish: str | None) -> CompletionChoice:
        return self._choice(index, generation, collected.text, collected.token_ids, collected.logprobs, finish, True)

    def chunk(self, index: int, generation: Generation, output: RequestOutput) -> CompletionChoice | None:
        """The chunk for a streamed output; None when it has nothing to say."""
        first = index not in self._offsets
        if self.scores_only and output.finish_reason is None:
            return None
        entries = output.logprobs or []
        choice = self._choice(
            index, generation, output.new_text, output.new_token_ids, entries, output.finish_reason, first
        )
        says_something = choice.text or choice.finish_reason or first or choice.logprobs or choice.token_ids
        return choice if says_something else None

    def _choice(
        self,
        index: int,
        generation: Generation,
        text: str,
        token_ids: list[int],
        entries: list[TokenLogprob],
        finish: str | None,
        first: bool,
    ) -> CompletionChoice:
        request = self.request
        if self.scores_only:
            text, token_ids, entries = "", [], []
        echo = request.echo and first
        prompt_ids = generation.prompt_token_ids
        logprobs = None
        if request.logprobs is not None:
            ids: list[int] = list(token_ids)
            all_entries: list[TokenLogprob | None] = list(entries)
            if echo:
                ids = prompt_ids + ids
                all_entries = list(generation.prompt_logprobs or [None] * len(prompt_ids)) + all_entries
            logprobs, self._offsets[index] = completion_logprobs(
                ids, all_entries, request.logprobs, self.texts, self._offsets.get(index, 0)
            )
        else:
            self._offsets.setdefault(index, 0)
        prompt_lp = None
        if first and request.prompt_logprobs is not None and generation.prompt_logprobs is not None:
            prompt_lp = prompt_logprobs(generation.prompt_logprobs, request.prompt_logprobs, self.texts)
        with_ids = request.return_token_ids
        return CompletionChoice(
            index=index,
            text=(self.prompt_texts[index // request.n] if echo else "") + text,
            logprobs=logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            prompt_logprobs=prompt_lp,
            prompt_token_ids=prompt_ids if with_ids and first else None,
            token_ids=token_ids if with_ids else None,
        )


@dataclass
class ChatShape:
    """`tool_format`: the format the output's tool calls are read in; None when the request has no tools to call
    (no tools, or tool_choice none), and the output is all content."""

    request: ChatCompletionRequest
    texts: TokenTexts
    tool_format: ToolCallFormat | None = None
    _streams: dict[int, ToolCallStream] = field(default_factory=dict, init=False)

    def message(self, text: str, finish: str | None) -> tuple[AssistantMessage, str | None]:
        """A whole choice's message and finish reason ("tool_calls" when it ended calling tools)."""
        if self.tool_format is None:
            return AssistantMessage(content=text), finish
        parsed = parse_output(self.tool_format, text)
        calls = self._allowed(parsed.calls, 0)
        if not calls:
            return AssistantMessage(content=parsed.content), finish
        out = [ToolCallOut(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments)) for c in calls]
        return AssistantMessage(content=parsed.content, tool_calls=out), _with_calls(finish)

    def stream_delta(self, index: int, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        """A streamed choice's new content and tool-call deltas (each call: its name, then its arguments)."""
        if self.tool_format is None:
            return text, []
        stream = self._streams.setdefault(index, ToolCallStream(self.tool_format))
        num_before = stream.num_calls
        delta = stream.feed(text)
        if finished:
            rest = stream.finish()
            delta = StreamDelta(delta.content + rest.content, delta.calls + rest.calls)
        deltas = []
        for place, call in enumerate(self._allowed(delta.calls, num_before), start=num_before):
            deltas.append(
                ToolCallDelta(
                    index=place, id=call.id, type="function", function=FunctionDelta(name=call.name, arguments="")
                )
            )
            deltas.append(ToolCallDelta(index=place, function=FunctionDelta(arguments=call.arguments)))
        return delta.content, deltas

    def stream_finish_reason(self, index: int, finish: str) -> str:
        stream = self._streams.get(index)
        return "tool_calls" if finish == "stop" and stream is not None and stream.num_calls else finish

    def _allowed(self, calls: list[ToolCall], num_before: int) -> list[ToolCall]:
        """Without parallel_tool_calls, only the first call of the message counts."""
        if self.request.parallel_tool_calls is False:
            return calls[: max(0, 1 - num_before)]
        return calls

    @property
    def is_plain(self) -> bool:
        """Content chunks carry text and finish reason alone (sse_chunks.py writes them): no logprobs, no token ids,
        no tool calls to read out of the text."""
        return not self.request.logprobs and not self.request.return_token_ids and self.tool_format is None

    def logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if not self.request.logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(entries or [], self.texts))

    def token_ids(self, token_ids: list[int]) -> list[int] | None:
        return token_ids if self.request.return_token_ids else None

    def prompt_logprobs(self, generation: Generation) -> PromptLogprobs | None:
        """The prompt's, as a completion's choice carries them; the engine hands them out with the generation's
        first output, which the response (or the role chunks of a stream) waits for."""
        k = self.request.prompt_logprobs
        if k is None or generation.prompt_logprobs is None:
            return None
        return prompt_logprobs(generation.prompt_logprobs, k, self.texts)


def _with_calls(finish: str | None) -> str | None:
    # A message cut short by the token limit says so, whatever calls it completed before.
    return "tool_calls" if finish == "stop" else finish
