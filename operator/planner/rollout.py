"""Rolling new weights into running ranks in place: replica by replica, at most maxUnavailable at once.

A failed update (the worker refuses a bad checkpoint and keeps its old weights) stops the roll for that version; the
failure is remembered in status.weightsRollout until spec.weights names another version. The served version in
status changes only when every rank reports the same version with the same checksum; ranks that report one version
with different checksums are ChecksumMismatch (Degraded) until spec.weights names another version, which rolls.
"""

from dataclasses import dataclass
from typing import Literal

from tidal.operator.api.status import InferenceModelStatus, WeightsRolloutStatus
from tidal.operator.builders.pod import desired_weights
from tidal.operator.planner.actions import Action, UpdateWeights
from tidal.operator.planner.facts import Facts, RankSlot

SyncState = Literal[
    "Synced", "RollingOut", "WaitingForRanks", "PausedWhileAsleep", "UpdateFailed", "ChecksumMismatch", "NoRanks"
]


@dataclass(frozen=True)
class RolloutPlan:
    actions: list[Action]
    desired_version: str
    served_version: str | None
    sync: SyncState
    failure: WeightsRolloutStatus | None


def _failure(facts: Facts, version: str, previous: InferenceModelStatus | None) -> WeightsRolloutStatus | None:
    held = previous.weights_rollout if previous is not None else None
    if held is not None and held.failed_version == version:
        return held
    for slot in facts.slots:
        failed = slot.observation.update_failure
        if failed is not None and failed.version == version:
            return WeightsRolloutStatus(failed_version=version, message=f"{slot.name}: {failed.message}")
    return None


def _agreed_version(slots: list[RankSlot], one_checksum: bool) -> tuple[str | None, bool]:
    """(version every rank serves with one checksum, or None; True when every rank reports one version with
    different checksums: the ranks serve different weights under one label).

    With expert parallelism each rank's checksum covers the experts it holds (and every dense tensor), so ranks
    differ by design: then every rank must report the version and its checksum, and no two are compared."""
    if not slots:
        return None, False
    pairs = []
    for slot in slots:
        state = slot.state
        if not slot.loaded or state is None or state.weights_version is None or slot.observation.checksum is None:
            return None, False
        pairs.append((state.weights_version, slot.observation.checksum))
    versions = {v for v, _ in pairs}
    if len(versions) != 1:
        return None, False
    if one_checksum and len({s for _, s in pairs}) != 1:
        return None, True
    return versions.pop(), False


def _out_of_date(slot: RankSlot, version: str) -> bool:
    return slot.state is not None and slot.state.weights_version != version


def plan_rollout(
    facts: Facts, asleep: bool, budget: int, skip_replicas: frozenset[int], previous: InferenceModelStatus | None
) -> RolloutPlan:
    source, version = desired_weights(facts.model.spec)
    agreed, mismatch = _agreed_version(facts.slots, one_checksum=facts.ranks_per_replica == 1)
    served = agreed if agreed is not None else (previous.weights_version if previous is not None else None)
    failure = _failure(facts, version, previous)
    actions: list[Action] = []
    if not facts.slots:
        return RolloutPlan(actions, version, served, "NoRanks", failure)
    if agreed == version:
        return RolloutPlan(actions, version, served, "Synced", None)
    if failure is not None:
        return RolloutPlan(actions, version, served, "UpdateFailed", failure)
    behind = [s for s in facts.slots if _out_of_date(s, version)]
    if mismatch and not behind:
        # The desired version itself is served with different checksums. A mismatch on an older version does not
        # stop a roll: a new version is the documented remedy, so it must reach the ranks.
        return RolloutPlan(actions, version, served, "ChecksumMismatch", None)
    if not behind:
        # Nothing reports an old version: ranks are still loading (they start on the desired weights) or checksums
        # are not in yet.
        return RolloutPlan(actions, version, served, "WaitingForRanks", None)
    if asleep:
        return RolloutPlan(actions, version, served, "PausedWhileAsleep", None)
    for replica in range(facts.replicas):
        if replica in skip_replicas or budget == 0:
            continue
        slots = facts.replica_slots(replica)
        stale = [s for s in slots if _out_of_date(s, version)]
        # Only a replica whose every rank is ready and awake is updated; the others get there first.
        if not stale or not all(s.ready and s.loaded and not s.asleep for s in slots):
            continue
        budget -= 1
        actions += [UpdateWeights(pod=s.name, replica=replica, source=source, version=version) for s in stale]
    return RolloutPlan(actions, version, served, "RollingOut", None)
