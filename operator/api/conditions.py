"""Pure helpers for conditions: lastTransitionTime moves only when a condition's status flips."""

from datetime import datetime

from tidal.operator.api.status import Condition, ConditionStatus, ConditionType


def find_condition(conditions: list[Condition], type_: ConditionType) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def set_condition(
    conditions: list[Condition],
    type_: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """Return a new list with `type_` set; its lastTransitionTime is kept unless `status` differs from before."""
    previous = find_condition(conditions, type_)
    since = previous.last_transition_time if previous is not None and previous.status == status else now
    updated = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    if previous is None:
        return [*conditions, updated]
    return [updated if c.type == type_ else c for c in conditions]


def flipped(before: list[Condition], after: list[Condition]) -> list[Condition]:
    """Conditions in `after` whose status differs from `before` (or that are new): the ones worth an Event."""
    out = []
    for cond in after:
        old = find_condition(before, cond.type)
        if old is None or old.status != cond.status:
            out.append(cond)
    return out
