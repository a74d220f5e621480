"""IncrementalDetokenizer with a fake tokenizer: text deltas add up, and a run of text-less tokens stays cheap."""

from __future__ import annotations

from tidal.worker.engine.detokenizer import IncrementalDetokenizer

UNKNOWN = 1000  # ids from here on decode to nothing, as ids beyond a tokenizer's vocabulary do


class CharTokenizer:
    """id -> chr(id); ids >= UNKNOWN vanish. Records the longest id list it was asked to decode."""

    def __init__(self) -> None:
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.longest = max(self.longest, len(ids))
        return "".join(chr(i) for i in ids if i < UNKNOWN)


def test_deltas_add_up_and_textless_runs_do_not_grow_the_window():
    tokenizer = CharTokenizer()
    det = IncrementalDetokenizer(tokenizer, [ord("a")] * 50, skip_special_tokens=True)  # type: ignore[arg-type]
    ids = [ord("x")] + [UNKNOWN + i for i in range(300)] + [ord("y"), ord("z")]
    text = "".join(det.push([i]) for i in ids) + det.flush()
    assert text == "xyz"
    assert tokenizer.longest <= 10  # the context window plus the new token, not 300 ids
