"""Turning a request into prompt token ids: plain text, given token ids, or chat messages through the chat template.

The work runs on `PromptBuilder`'s own threads, never on the event loop: a template renders for as long as its Jinja
and its input make it, and tokenizing a megabyte of text takes seconds, during which every other stream, the probes
and the control API (same loop) used to stall.

A text that cannot fit the prompt limit, whatever it encodes to, is refused before it is tokenized (`token_floor`):
tokenizing 8 MB of it held a thread for 12 s only to refuse it. Otherwise whether the ids are acceptable (not empty,
within the context, inside the vocabulary) is the engine's call, made before it queues anything; `Generation.start`
turns its refusal into a 400.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from tidal.worker.server.errors import ApiError
from tidal.worker.server.prompt_batch import Prompt
from tidal.worker.server.prompt_limit import PromptLimit
from tidal.worker.server.protocol import ChatMessage
from tidal.worker.server.token_floor import TokenFloor, token_floor

T = TypeVar("T")

# Names the template gets from this server (or that shape what apply_chat_template returns); a request may not set
# them, whatever the flags say.
_SET_BY_SERVER = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize", "return_dict"})
# Arguments that replace the model's template (`chat_template`: Jinja the client wrote, or another named template) or
# put client-written structure into it (`tools`, `documents`). The request's own `tools` field is different: those are
# checked function definitions (protocol.py), handed to the template as its `tools` argument.
TEMPLATE_CHANGING_KWARGS = frozenset({"chat_template", "tools", "documents"})


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the server uses."""

    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str | list[str]: ...

    def __len__(self) -> int: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


class PromptBuilder:
    """Builds prompts on `threads` threads of its own; `close()` when the server stops."""

    def __init__(self, threads: int, allow_request_chat_template: bool = False) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tidal-prompt")
        self._allow_request_chat_template = allow_request_chat_template
        # By id, with the tokenizer itself: held here, its id cannot be reused by another.
        self._floors: dict[int, tuple[Tokenizer, TokenFloor | None]] = {}

    def token_floor(self, tokenizer: Tokenizer) -> TokenFloor | None:
        """The tokenizer's token floor, found on first use (a pass over its vocabulary, tens of milliseconds): the
        worker asks on the thread that loads the model, so that no request does. Two threads that both find it
        first find the same floor."""
        found = self._floors.get(id(tokenizer))
        if found is None:
            found = (tokenizer, token_floor(tokenizer))
            self._floors[id(tokenizer)] = found
        return found[1]

    async def completion_ids(self, tokenizer: Tokenizer, prompts: list[Prompt], limit: PromptLimit) -> list[list[int]]:
        """Each prompt's ids: text tokenized, refused (400) past `limit`; token ids as sent (checked later).

        One task takes a request's texts in turn and stops at the first one over the limit. Spread over the threads,
        a list of texts each just short of the floor (8 MB in all) held every thread for seconds, as one 8 MB text
        did; in turn, at most one of them is tokenized in vain."""
        token_ids = [p for p in prompts if not isinstance(p, str)]
        if len(token_ids) == len(prompts):
            return [list(p) for p in token_ids]
        return await self._run(functools.partial(self._completion_ids, tokenizer, prompts, limit))

    def _completion_ids(self, tokenizer: Tokenizer, prompts: list[Prompt], limit: PromptLimit) -> list[list[int]]:
        floor = self.token_floor(tokenizer)
        all_ids = []
        for prompt in prompts:
            ids = completion_prompt_ids(tokenizer, prompt, limit, floor)
            if isinstance(prompt, str):
                limit.check_count(len(ids), "prompt")
            all_ids.append(ids)
        return all_ids

    async def chat_ids(
        self,
        tokenizer: Tokenizer,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        limit: PromptLimit | None = None,
    ) -> list[int]:
        """The conversation's ids; with `limit`, a rendered text that cannot fit it is refused before tokenizing."""
        check_template_kwargs(tokenizer, template_kwargs, self._allow_request_chat_template)
        if tools and template_kwargs and "tools" in template_kwargs:
            raise ApiError(400, "send tools in the tools field or in chat_template_kwargs, not both", param="tools")

        def build() -> list[int]:
            floor = self.token_floor(tokenizer)
            return chat_prompt_ids(
                tokenizer, messages, add_generation_prompt, template_kwargs, add_special_tokens, tools, limit, floor
            )

        return await self._run(build)

    async def text_ids(
        self, tokenizer: Tokenizer, text: str, add_special_tokens: bool, limit: PromptLimit | None = None
    ) -> list[int]:
        """`text` tokenized, with or without the tokenizer's special tokens (`/tokenize`); with `limit`, refused if
        it cannot fit it."""
        return await self._run(
            lambda: text_token_ids(tokenizer, text, add_special_tokens, limit, self.token_floor(tokenizer))
        )

    async def text_of(self, tokenizer: Tokenizer, token_ids: list[int]) -> str:
        """Token ids back to text (`/detokenize`)."""
        return await self._run(functools.partial(token_ids_text, tokenizer, token_ids))

    def close(self) -> None:
        """Drop the prompts still waiting for a thread; one being built finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, build: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, build)


def check_template_kwargs(
    tokenizer: Tokenizer, template_kwargs: dict[str, Any] | None, allow_request_chat_template: bool
) -> None:
    """400 unless every key of `chat_template_kwargs` is a variable for the template.

    apply_chat_template takes the template's variables and its own arguments in one set of keyword arguments, so a
    key that names one of its arguments (as the installed tokenizer declares them) is not data: `chat_template`
    swaps in the client's Jinja, `tokenize` changes what comes back. Those that change the template are allowed
    only when the operator turned `allow_request_chat_template` on.
    """
    if not template_kwargs:
        return
    arguments = _SET_BY_SERVER | TEMPLATE_CHANGING_KWARGS | _named_parameters(tokenizer.apply_chat_template)
    for key in template_kwargs:
        if key in TEMPLATE_CHANGING_KWARGS:
            if allow_request_chat_template:
                continue
            message = (
                f"chat_template_kwargs.{key} would change the model's chat template with client-written content; "
                "this worker does not allow it (allow_request_chat_template)"
            )
        elif key in arguments:
            message = f"chat_template_kwargs.{key} is an argument of the chat template call, not a template variable"
        else:
            continue
        raise ApiError(400, message, param=f"chat_template_kwargs.{key}", code="chat_template_kwargs_refused")


def _named_parameters(function: Callable[..., Any]) -> frozenset[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a callable without a readable signature: the fixed sets still apply
        return frozenset()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in kinds)


def unicode_text(text: str, param: str) -> str:
    """`text`, if it is valid Unicode. JSON may escape a lone UTF-16 surrogate (`"\\ud800"`), which Python keeps in
    a str but no tokenizer can encode (a TypeError deep inside it): refused here as the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end].encode("unicode_escape").decode("ascii")
        message = f"the text has a lone UTF-16 surrogate ({bad}) at {exc.start}: not Unicode"
        raise ApiError(400, message, param=param) from exc
    return text


def completion_prompt_ids(
    tokenizer: Tokenizer, prompt: Prompt, limit: PromptLimit | None = None, floor: TokenFloor | None = None
) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    return list(tokenizer.encode(_fitting_text(prompt, "prompt", limit, floor)))


def text_token_ids(
    tokenizer: Tokenizer,
    text: str,
    add_special_tokens: bool,
    limit: PromptLimit | None = None,
    floor: TokenFloor | None = None,
) -> list[int]:
    # A keyword: Hugging Face's second positional argument is a second text (`text_pair`).
    return list(tokenizer.encode(_fitting_text(text, "prompt", limit, floor), add_special_tokens=add_special_tokens))


def _fitting_text(text: str, param: str, limit: PromptLimit | None, floor: TokenFloor | None) -> str:
    """`text`, if it is Unicode that might encode to at most `limit` tokens (400 otherwise)."""
    text = unicode_text(text, param)
    if limit is not None:
        limit.check_text(floor, text, param)
    return text


def token_ids_text(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    text = tokenizer.decode(token_ids)
    if not isinstance(text, str):  # a list of texts comes only from a batch of id lists
        raise ApiError(500, f"the tokenizer decoded one id list to {type(text).__name__}, expected text")
    return text


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
    limit: PromptLimit | None = None,
    floor: TokenFloor | None = None,
) -> list[int]:
    """Render the conversation with the model's chat template, then tokenize the text. `tools`: the function
    definitions the template writes into the prompt, in its family's words; `limit`: refuse a text that cannot fit
    it (by `floor`) before tokenizing it.

    Rendering to text first (rather than `tokenize=True`) keeps one code path across tokenizer versions, whose
    return type for tokenized templates has changed; the template already writes the special tokens it wants, so
    none are added on top unless asked (`/tokenize` takes `add_special_tokens`, as vLLM's does).
    """
    if not tokenizer.chat_template and not (template_kwargs or {}).get("chat_template"):
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation = [_as_template_message(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
            **({"tools": tools} if tools else {}),
        )
    except Exception as exc:  # a Jinja template raises whatever it likes (e.g. "roles must alternate")
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    if not isinstance(text, str):
        raise ApiError(500, f"the chat template returned {type(text).__name__}, expected text")
    text = _fitting_text(text, "messages", limit, floor)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _as_template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        # Templates write a call's arguments with `tojson`: they expect an object, not the JSON text OpenAI sends.
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # as sent: the template shows what the model wrote, malformed or not
        return text
