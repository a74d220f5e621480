"""The step header's decisions: every rank takes the same one from the same headers."""

from tidal.worker.engine.lockstep import StepHeader, decide, version_tag

V = version_tag("base")


def _h(has_work: bool = False, paused: bool = False, version: int = V, ready: int = 0) -> StepHeader:
    return StepHeader(has_work, paused, version, ready)


def test_the_header_round_trips_through_its_integers():
    header = StepHeader(True, False, version_tag("v2"), 7)
    assert StepHeader.decode(header.encode()) == header
    assert version_tag("v2") == version_tag("v2") != version_tag("v3")
    assert 0 <= version_tag(None) < 2**31


def test_the_group_steps_when_any_rank_has_work_and_idles_when_none_has():
    assert decide([_h(), _h(True), _h()], [0, 1, 2]).step  # ranks 0 and 2 run empty steps
    idle = decide([_h(), _h(), _h()], [0, 1, 2])
    assert not idle.step and idle.group_idle


def test_a_paused_rank_or_two_versions_stop_every_rank():
    paused = decide([_h(True), _h(paused=True)], [0, 3])
    assert not paused.step and not paused.group_idle and "ranks [3] are paused" in (paused.waiting_on or "")
    mixed = decide([_h(True), _h(version=version_tag("v2"))], [0, 1])
    assert not mixed.step and "different weights versions" in (mixed.waiting_on or "")


def test_the_switch_waits_for_every_staying_rank_and_ignores_a_leaving_one():
    members = [0, 1, 2]
    # Epoch 5 keeps ranks 0 and 1; rank 2 leaves (not ready, not needed).
    assert decide([_h(True, ready=5), _h(ready=5), _h(True)], members, 5, [0, 1]).switch
    not_yet = decide([_h(True, ready=5), _h(), _h()], members, 5, [0, 1])
    assert not not_yet.switch and not_yet.step  # the old epoch goes on meanwhile
    # A rank that has not prepared the epoch (no next_epoch of its own) never switches alone.
    assert not decide([_h(ready=5), _h(ready=5), _h()], members).switch
