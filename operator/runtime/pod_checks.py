"""Ask the API server, with a server-side dry run, whether it admits the pods a pass may create or replace.

The planner must not delete a serving pod for one the API server refuses: the healthy pod went first, then every
create failed, and the model was out until someone read the operator's log. So before planning, each pod that
`pods.pods_to_check` lists is created with `dryRun=All` (decoding, validation and admission run, nothing is stored),
and the refusals reach the planner as `PlanInput.pod_refusals`, by spec hash.

Verdicts are remembered by spec hash in the model's memory, for the hashes the spec still asks for: a pod is asked
about once, not on every pass. A refusal is asked about again after REFUSAL_RECHECK_S (webhooks, policies and
quotas change under a model whose spec does not). A create the API server refuses for real is remembered the same
way (the executor records it), so it is surfaced by the next pass instead of failing every pass.

Two answers are not about the pod and count as admitting it: a webhook that cannot take a dry run (the question was
refused, not the pod), and an exceeded quota for a pod that replaces a running one (the pod it replaces still holds
its share; deleting first is what lets it fit).
"""

from __future__ import annotations

import asyncio
import logging
import time

from tidal.operator.kube.client import KubeApi
from tidal.operator.kube.refusal import Refusal
from tidal.operator.planner.pods import PodToCheck
from tidal.operator.runtime.memory import ModelMemory, PodVerdict
from tidal.operator.runtime.queue import Key

log = logging.getLogger("tidal.operator.pod_checks")

REFUSAL_RECHECK_S = 5.0


def _is_current(verdict: PodVerdict | None, now: float) -> bool:
    if verdict is None:
        return False
    return verdict.refusal is None or now - verdict.at < REFUSAL_RECHECK_S


def _verdict(check: PodToCheck, refusal: Refusal | None) -> str | None:
    if refusal is None or refusal.dry_run_unsupported or (refusal.over_quota and check.replaces):
        return None
    return refusal.message


async def check_pods(kube: KubeApi, key: Key, memory: ModelMemory, checks: list[PodToCheck]) -> dict[str, str]:
    """spec hash -> the API server's message, for each pod in `checks` it refuses. Asks only about pods without a
    current verdict; verdicts for hashes not in `checks` are dropped (the spec moved on, or the pod exists)."""
    now = time.monotonic()
    wanted = {check.spec_hash: check for check in checks}
    memory.pod_verdicts = {h: v for h, v in memory.pod_verdicts.items() if h in wanted}
    ask = [check for h, check in wanted.items() if not _is_current(memory.pod_verdicts.get(h), now)]
    answers = await asyncio.gather(*(kube.dry_run_pod(check.manifest) for check in ask))
    for check, answer in zip(ask, answers, strict=True):
        verdict = _verdict(check, answer)
        previous = memory.pod_verdicts.get(check.spec_hash)
        name = check.manifest["metadata"]["name"]
        if answer is not None and verdict is None:
            log.info("%s/%s: dry run of pod %s: %s (not a refusal of the pod)", *key, name, answer.message)
        elif verdict is not None and (previous is None or previous.refusal != verdict):
            log.warning("%s/%s: the API server refuses pod %s: %s", *key, name, verdict)
        memory.record_pod_verdict(check.spec_hash, verdict)
    return {h: v.refusal for h, v in memory.pod_verdicts.items() if v.refusal is not None}
