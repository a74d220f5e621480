"""The per-model memory: one object per model, dropped whole by forget(); streaks stop at their cap."""

from tidal.operator.planner.observed import UpdateFailure
from tidal.operator.runtime.memory import MAX_STREAK, ModelMemories, RollStart


def test_forget_drops_the_whole_object_and_a_held_one_stays_detached():
    memories = ModelMemories()
    memory = memories.of(("ns", "m"))
    assert memories.of(("ns", "m")) is memory and len(memories) == 1
    memory.count_error()
    memory.roll = RollStart("v2", 1.0)
    memory.update_failures["m-r0-0"] = UpdateFailure(version="v2", message="bad")
    memories.forget(("ns", "m"))
    assert ("ns", "m") not in memories and len(memories) == 0
    memory.count_failed_calls()  # a pass still running writes here...
    assert ("ns", "m") not in memories  # ...without bringing the model back
    fresh = memories.of(("ns", "m"))  # a model re-created under the same name starts empty
    assert fresh is not memory and fresh.error_streak == 0 and fresh.roll is None and not fresh.update_failures
    memories.forget(("ns", "other"))  # forgetting a model never seen is fine


def test_streaks_stop_at_their_cap_and_checksums_follow_the_pods():
    memory = ModelMemories().of(("ns", "m"))
    assert [memory.count_error() for _ in range(MAX_STREAK + 3)][-1] == MAX_STREAK
    memory.checksums = {("uid-1", "v1", "/m/v1"): "a", ("uid-2", "v1", "/m/v1"): "b"}
    memory.keep_checksums_of({"uid-2"})
    assert memory.checksums == {("uid-2", "v1", "/m/v1"): "b"}
