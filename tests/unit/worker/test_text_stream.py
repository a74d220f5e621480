"""Stop conditions and streamed text with stop strings (a fake detokenizer: one character per token)."""

from __future__ import annotations

from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.sequence import Sequence
from tidal.worker.engine.stop_checker import find_stop_string, partial_stop_len, token_stop_reason
from tidal.worker.engine.text_stream import TextStream


class CharDetokenizer:
    def push(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def flush(self) -> str:
        return ""


def stream(text: str, **params) -> tuple[list[str], TextStream]:
    ts = TextStream(CharDetokenizer(), SamplingParams(**params))  # type: ignore[arg-type]
    deltas = []
    for ch in text:
        deltas.append(ts.push([ord(ch)]))
        if ts.stopped:
            break
    return deltas, ts


def test_stop_string_cuts_text_and_is_never_streamed():
    deltas, ts = stream("hello END world", stop=["END"])
    assert ts.stopped
    assert "".join(deltas) == "hello "
    assert all("E" not in d for d in deltas)


def test_stop_string_included_when_asked():
    deltas, _ = stream("ab##cd", stop=["##"], include_stop_str_in_output=True)
    assert "".join(deltas) == "ab##"


def test_held_back_prefix_released_when_it_is_not_a_stop():
    deltas, ts = stream("aXYb", stop=["XYZ"])
    assert deltas == ["a", "", "", "XYb"]
    assert not ts.stopped


def test_flush_releases_held_text_at_the_end():
    deltas, ts = stream("abX", stop=["XY"])
    assert "".join(deltas) == "ab"
    assert ts.flush() == "X"


def test_earliest_of_several_stops():
    assert find_stop_string("a-b+c", ["+", "-"], 0) == (1, "-")
    assert partial_stop_len("abc", ["cde", "bcx"]) == 2


def test_token_stops():
    params = SamplingParams(max_tokens=3, stop_token_ids=[42])
    s = Sequence(0, "r", [1, 2], params)
    s.append_token(5)
    assert token_stop_reason(s, {9}, 100) is None
    s.append_token(42)
    assert token_stop_reason(s, {9}, 100) == "stop"
    s2 = Sequence(1, "r", [1], SamplingParams(max_tokens=2))
    s2.append_token(9)
    assert token_stop_reason(s2, {9}, 100) == "stop"
    s3 = Sequence(2, "r", [1], SamplingParams(max_tokens=2, ignore_eos=True))
    s3.append_token(9)
    assert token_stop_reason(s3, {9}, 100) is None
    s3.append_token(9)
    assert token_stop_reason(s3, {9}, 100) == "length"
    s4 = Sequence(3, "r", [1, 2, 3], SamplingParams(max_tokens=None))
    s4.append_token(4)
    assert token_stop_reason(s4, set(), 4) == "length"
