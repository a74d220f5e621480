"""What the operator remembers about each model from one pass to the next: one object per model, in one map.

The planner keeps no state, and whatever must survive an operator restart lives in the model's status. What is
kept here are hints and clocks a fresh process can do without: back-off streaks, when the current weight roll began
(for its duration metric), the checksums already read, and weight updates the worker refused (which `/state` does
not report). Holding all of it in one `ModelMemory` means a deleted model is forgotten by one `forget(key)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.operator.planner.observed import UpdateFailure
from tidal.operator.runtime.queue import Key

# A streak stops growing here: 2.0**streak overflows a float after 1023, and 2**16 s is far past any back-off cap.
MAX_STREAK = 16


@dataclass(frozen=True)
class RollStart:
    """The weights version being rolled out, and when (time.monotonic()) its first update was sent."""

    version: str
    started: float


@dataclass
class ModelMemory:
    error_streak: int = 0  # passes in a row that raised
    unavailable_streak: int = 0  # passes in a row whose every worker call was answered "not now"
    roll: RollStart | None = None
    # (pod UID, weights version) -> checksum: the digest of one version in one process cannot change, and hashing a
    # large checkpoint on every pass would be wasteful.
    checksums: dict[tuple[str, str], str] = field(default_factory=dict)
    # pod -> the last weight update it refused (cleared by its next successful update).
    update_failures: dict[str, UpdateFailure] = field(default_factory=dict)

    def count_error(self) -> int:
        self.error_streak = min(self.error_streak + 1, MAX_STREAK)
        return self.error_streak

    def count_unavailable(self) -> int:
        self.unavailable_streak = min(self.unavailable_streak + 1, MAX_STREAK)
        return self.unavailable_streak

    def keep_checksums_of(self, pod_uids: set[str]) -> None:
        """Drop the checksums of processes that are gone, so the cache stays as small as the model."""
        self.checksums = {key: value for key, value in self.checksums.items() if key[0] in pod_uids}


class ModelMemories:
    """The memory of every model this process has reconciled, by (namespace, name)."""

    def __init__(self) -> None:
        self._by_model: dict[Key, ModelMemory] = {}

    def of(self, key: Key) -> ModelMemory:
        """The model's memory, new and empty the first time the model is seen (or after it was forgotten)."""
        memory = self._by_model.get(key)
        if memory is None:
            memory = self._by_model[key] = ModelMemory()
        return memory

    def forget(self, key: Key) -> None:
        """The model is gone. A pass still running for it keeps writing into its own, now detached, object."""
        self._by_model.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._by_model

    def __len__(self) -> int:
        return len(self._by_model)
