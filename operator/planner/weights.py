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
    # What every rank that serves serves with one checksum, ranks still starting on the desired weights left out
    # (None: they differ, some do not report it yet, or none serves).
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


def _serves_nothing_until(slot: RankSlot, new_pod: Weights | None) -> Weights | None:
    """For a rank that serves nothing now, the weights it will serve once it does (None: it serves, or may, or
    what it will load is not known). No pod (or one going away): a new pod's, `new_pod`. A pod not ready gets no
    request; its worker, started or restarted, loads its start weights, unless it loaded already (then it counts
    with what it reports)."""
    pod = slot.pod
    if pod is None or pod.terminating or pod.finished:
        return new_pod
    if slot.observation.token_rejected or slot.loaded or (pod.ready and slot.state is None):
        return None  # serving what it reports, or answering nothing while it may serve
    return pod.start_weights


def _agreement(
    slots: list[RankSlot], desired: Weights, new_pod: Weights | None, one_checksum: bool
) -> tuple[Weights | None, bool]:
    """(the weights every rank that serves serves with one checksum, or None; True when they report the same
    weights with different checksums).

    A rank that serves nothing yet and will load the desired weights (a scale-up's new pod, a pod replaced or
    restarting on them) does not count: it cannot serve other weights, and counting it would turn WeightsSynced
    False and back on every such change. Any other rank that does not report its weights and checksum leaves
    agreement unknown; so does no rank reporting at all.

    With expert parallelism each rank's checksum covers the experts it holds (and every dense tensor), so ranks
    differ by design: then every rank must report its weights and checksum, and no two checksums are compared."""
    reported: list[tuple[Weights, str]] = []
    for slot in slots:
        weights, checksum = slot.weights, slot.observation.checksum
        if slot.loaded and weights is not None and checksum is not None:
            reported.append((weights, checksum))
            continue
        will_load = _serves_nothing_until(slot, new_pod)
        if will_load is None or not will_load.same_as(desired):
            return None, False
    agreed = common_weights([w for w, _ in reported])
    if agreed is None:
        return None, False
    if one_checksum and len({s for _, s in reported}) != 1:
        return None, True
    return agreed, False


def common_weights(weights: list[Weights | None]) -> Weights | None:
    """The weights all of `weights` name, with the directory any of them knows (None: they differ, one is not
    known, or there are none). A source not known matches any, as in `Weights.same_as`."""
    if not weights or any(w is None for w in weights):
        return None
    known = [w for w in weights if w is not None]
    versions = {w.version for w in known}
    sources = {posixpath.normpath(w.source) for w in known if w.source is not None}
    if len(versions) != 1 or len(sources) > 1:
        return None
    return Weights(versions.pop(), sources.pop() if sources else None)


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
    """Agreement goes by the ranks as the status sees them (`Facts.reported_slots`): a rank that briefly missed
    `/state` keeps its last answer."""
    desired = desired_weights(facts.model.spec)
    failure = _failure(facts, desired, previous)
    # A new pod starts on the desired weights unless a roll to them is held as failed (then on what served).
    new_pod = desired if failure is None else None
    one_checksum = facts.ranks_per_replica == 1
    agreed, mismatch = _agreement(facts.reported_slots(), desired, new_pod, one_checksum)
    served = _served(agreed, desired, previous)
    return WeightsView(desired, agreed, mismatch, served, failure)


NAMED_PER_WEIGHTS = 5  # pods a message names for one set of weights, then a count


def served_by(slots: list[RankSlot]) -> str:
    """Which ranks serve which weights, for a message: "v2 on tiny-r0-0; base on tiny-r1-0, tiny-r2-0". A version
    served from two directories names them; ranks that serve nothing, or do not say, are "no weights reported by"."""
    by_weights: dict[Weights | None, list[str]] = {}
    for slot in slots:
        weights = slot.weights if slot.loaded else None
        by_weights.setdefault(weights, []).append(slot.name)
    versions = [w.version for w in by_weights if w is not None]
    parts = []
    for weights, pods in by_weights.items():
        named = ", ".join(pods[:NAMED_PER_WEIGHTS]) + (
            f" and {len(pods) - NAMED_PER_WEIGHTS} more" if len(pods) > NAMED_PER_WEIGHTS else ""
        )
        if weights is None:
            parts.append(f"no weights reported by {named}")
        else:
            label = weights.describe() if versions.count(weights.version) > 1 else weights.version
            parts.append(f"{label} on {named}")
    return "; ".join(parts)
