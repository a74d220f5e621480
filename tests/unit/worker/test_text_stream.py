"""Stop conditions and streamed text with stop strings (a fake detokenizer: one character per token)."""

from __future__ import annotations

from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.sequence import Sequence
from tidal.worker.engine.stop_checker import token_stop_reason
from tidal.worker.engine.stop_strings import StopStrings
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
    assert StopStrings(["+", "-"]).feed("a-b+c") == (1, "-")
    assert StopStrings(["bc", "abcd"]).feed("xabcd") == (1, "abcd")  # starts first, though it ends last
    partial = StopStrings(["cde", "bcx"])
    assert partial.feed("abc") is None and partial.partial_len == 2


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


def _by_brute_force(text: str, stops: list[str], before: int) -> tuple[tuple[int, str] | None, int]:
    """The earliest stop ending after `before`, and the longest end of text that starts a stop."""
    hits = [(i, s) for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > before]
    partial = max(
        (n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0
    )
    return (min(hits, key=lambda h: h[0]) if hits else None), partial


def test_stop_strings_match_brute_force_piece_by_piece():
    import random

    rng = random.Random(3)
    for _ in range(1500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        matcher, text = StopStrings(stops), ""
        for _ in range(rng.randint(1, 6)):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
            before, text = len(text), text + piece
            hit = matcher.feed(piece)
            expected_hit, expected_partial = _by_brute_force(text, stops, before)
            assert (hit[0] if hit else None) == (expected_hit[0] if expected_hit else None), (stops, text)
            if hit is not None:
                assert text.startswith(hit[1], hit[0])
                break
            assert matcher.partial_len == expected_partial, (stops, text)


def test_stop_strings_before_min_tokens_do_not_count():
    ts = TextStream(CharDetokenizer(), SamplingParams(stop=["END"], min_tokens=3))  # type: ignore[arg-type]
    first = ts.add_text("xEND", may_stop=False)  # min_tokens not reached: the stop string is text like any other
    assert not ts.stopped and first == "xEND"
    assert ts.add_text("yE", may_stop=True) == "y" and not ts.stopped  # "E" may start a stop: held back
    assert ts.add_text("ND", may_stop=True) == "" and ts.stopped


def test_min_tokens_holds_back_stop_ids_and_eos():
    params = SamplingParams(stop_token_ids=[5], min_tokens=2)
    seq = Sequence(0, "r", [1, 2], params, token_ids=[1, 2, 5])
    assert token_stop_reason(seq, {9}, max_model_len=100) is None  # 1 generated: too early to stop
    seq.token_ids = [1, 2, 3, 5]
    assert token_stop_reason(seq, {9}, max_model_len=100) == "stop"
