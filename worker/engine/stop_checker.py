"""When a sequence stops: by token (EOS, stop ids, max_tokens, max_model_len) and by stop string (pure)."""

from __future__ import annotations

from tidal.worker.engine.outputs import FinishReason
from tidal.worker.engine.sequence import Sequence


def token_stop_reason(seq: Sequence, eos_token_ids: set[int], max_model_len: int) -> FinishReason | None:
    """Checked after each sampled token; the token that stops generation stays in the output."""
    params = seq.params
    token_ids = seq.token_ids
    last = token_ids[-1]
    if (last in eos_token_ids and not params.ignore_eos) or last in params.stop_token_ids:
        return "stop"
    num_tokens = len(token_ids)
    if params.max_tokens is not None and num_tokens - len(seq.prompt_token_ids) >= params.max_tokens:
        return "length"
    if num_tokens >= max_model_len:
        return "length"
    return None


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest (index, stop) of a stop string in text that ends after `search_from`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, search_from - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string (held back, not streamed)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
