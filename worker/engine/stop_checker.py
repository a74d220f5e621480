"""When a sequence stops by token: EOS, stop ids, max_tokens, max_model_len (pure; stop strings: stop_strings.py)."""

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
