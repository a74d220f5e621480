"""Which weights the ranks should serve, which they serve together, and which a new pod starts on.

Weights are a (version, source) pair (`builders/weights.py`): a rank serves the desired weights when it reports the
desired version and, if it reports its source (`/state` `weights_source`), the desired directory. A worker older
than that field is taken at its version's word, so a change of source alone reaches it only when its pod is replaced.

A new pod starts on the desired weights, except while a roll to them is held as failed: then it starts on the last
weights that served (the status keeps their version and directory), so that it serves beside the ranks the failed
roll left on them instead of crash-looping on what failed, and it takes part in the next roll like them.
"""

import posixpath
from dataclasses import dataclass

from tidal.operator.api.status import InferenceModelStatus, WeightsRolloutStatus
from tidal.operator.builders.weights import Weights, desired_weights
from tidal.operator.planner.facts import Facts, RankSlot


@dataclass(frozen=True)
class WeightsView:
    desired: Weights
    # What every rank serves with one checksum (None: they differ, or some do not report it yet).
    agreed: Weights | None
    # Every rank reports one version, with different checksums: they serve different weights under one label.
    mismatch: bool
    # `agreed`, else what the last status recorded as served (a roll in progress or stopped leaves it).
    served: Weights | None
    # Set while a roll to `desired` is held as failed.
    failure: WeightsRolloutStatus | None

    @property
    def start(self) -> Weights:
        """What a pod created now loads at start."""
        served = self.served
        if self.failure is None or served is None or served.source is None or served.same_as(self.desired):
            return self.desired
        return served

    def serves_desired(self, slot: RankSlot) -> bool:
        weights = slot.weights
        return weights is not None and weights.same_as(self.desired)


def _agreement(slots: list[RankSlot], one_checksum: bool) -> tuple[Weights | None, bool]:
    """(the weights every rank serves with one checksum, or None; True when every rank reports the same weights
    with different checksums).

    With expert parallelism each rank's checksum covers the experts it holds (and every dense tensor), so ranks
    differ by design: then every rank must report its weights and checksum, and no two checksums are compared."""
    if not slots:
        return None, False
    reported: list[tuple[Weights, str]] = []
    for slot in slots:
        weights, checksum = slot.weights, slot.observation.checksum
        if not slot.loaded or weights is None or checksum is None:
            return None, False
        reported.append((weights, checksum))
    versions = {w.version for w, _ in reported}
    sources = {posixpath.normpath(w.source) for w, _ in reported if w.source is not None}
    if len(versions) != 1 or len(sources) > 1:
        return None, False
    if one_checksum and len({s for _, s in reported}) != 1:
        return None, True
    return Weights(versions.pop(), sources.pop() if sources else None), False


def _served(agreed: Weights | None, desired: Weights, previous: InferenceModelStatus | None) -> Weights | None:
    """The served weights with their directory wherever it can be known: workers that do not report it serve the
    desired directory if they serve the desired version, else the one the status recorded for their version."""
    recorded = None
    if previous is not None and previous.weights_version is not None:
        recorded = Weights(previous.weights_version, previous.weights_source)
    if agreed is None:
        return recorded
    if agreed.source is not None:
        return agreed
    if agreed.same_as(desired):
        return desired
    if recorded is not None and recorded.version == agreed.version:
        return recorded
    return agreed


def _failure(facts: Facts, desired: Weights, previous: InferenceModelStatus | None) -> WeightsRolloutStatus | None:
    held = previous.weights_rollout if previous is not None else None
    if held is not None and desired.same_as(Weights(held.failed_version, held.failed_source)):
        return held
    for slot in facts.slots:
        failed = slot.observation.update_failure
        if failed is not None and desired.same_as(Weights(failed.version, failed.source)):
            return WeightsRolloutStatus(
                failed_version=failed.version, failed_source=failed.source, message=f"{slot.name}: {failed.message}"
            )
    return None


def weights_view(facts: Facts, previous: InferenceModelStatus | None) -> WeightsView:
    desired = desired_weights(facts.model.spec)
    agreed, mismatch = _agreement(facts.slots, one_checksum=facts.ranks_per_replica == 1)
    served = _served(agreed, desired, previous)
    return WeightsView(desired, agreed, mismatch, served, _failure(facts, desired, previous))
