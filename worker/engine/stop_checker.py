"""When a sequence stops: by token (EOS, stop ids, max_tokens, max_model_len) and by stop string (pure)."""

from __future__ import annotations

from tidal.worker.engine.outputs import FinishReason
from tidal.worker.engine.sequence import Sequence


def token_stop_reason(
    seq: Sequence, eos_token_ids: set[int], max_model_len: int, num_tokens: int | None = None
) -> FinishReason | None:
    """Checked after each sampled token; the token that stops generation stays in the output. `num_tokens` is the
    sequence's length up to that token: all of it by default, less when the next step's token is already appended
    (async scheduling)."""
    params = seq.params
    if num_tokens is None:
        num_tokens = len(seq.token_ids)
    last = seq.token_ids[num_tokens - 1]
    stoppable = num_tokens - len(seq.prompt_token_ids) >= params.min_tokens  # the sampler bans them before that
    if stoppable and ((last in eos_token_ids and not params.ignore_eos) or last in params.stop_token_ids):
        return "stop"
    if reaches_length_limit(seq, num_tokens, max_model_len):
        return "length"
    return None


def reaches_length_limit(seq: Sequence, num_tokens: int, max_model_len: int) -> bool:
    """Whether a sequence of `num_tokens` tokens must end whatever its last token is (known before it is read)."""
    max_tokens = seq.params.max_tokens
    if max_tokens is not None and num_tokens - len(seq.prompt_token_ids) >= max_tokens:
        return True
    return num_tokens >= max_model_len


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest (index, stop) of a stop string in text that ends after `search_from`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, search_from - len(stop) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string (held back, not streamed).

    Runs for every new piece of text of a request with stop strings, on the step loop's thread: only the places in
    the text's tail where a stop's first character occurs are tried, each with one comparison done in C, so the cost
    stays within a stop string's length per stop even for tails like "aaaa..." (bounded by MAX_STOP_STRINGS and
    MAX_STOP_STRING_CHARS in sampling_params)."""
    longest = 0
    for stop in stops:
        tail_len = min(len(stop) - 1, len(text))
        if tail_len <= longest:
            continue
        start = len(text) - tail_len
        i = text.find(stop[0], start)
        while i != -1 and len(text) - i > longest:
            if stop.startswith(text[i:]):
                longest = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return longest
