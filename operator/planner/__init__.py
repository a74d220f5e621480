"""Pure planner: desired spec + observed pods and worker states -> typed actions and the next status.

`plan(PlanInput) -> Plan` is one level-based pass; it calls no API and keeps no state between passes (what must
survive, such as a failed weights version, lives in the status it returns). It runs inside the operator's runtime:
kopf's handlers only queue the model, and `runtime/reconcile.py` observes, plans and hands `Plan.actions` to
`runtime/execute.py`. The planner owes nothing to kopf; it relies on the runtime for the following.

Observing (build a `PlanInput`):
- `model`: `InferenceModel.model_validate(body)`. The status must be Tidal's alone, so kopf keeps its progress in
  annotations and the handlers return None (the structural schema prunes anything else in status).
- `pods`: the model's pods (label `tidal.dev/model=<name>`, and by name each rank's that the list lacks; controlled by
  this model's UID) through `observed.observe_pod`.
- `ranks`: per running pod, `GET /state` (and `GET /weights/checksum` for `checksum`) on the pod IP and its control port
  with the bearer token from the Secret; `state=None` when it does not answer (with `missed_reads`, the misses in a
  row, and `last_state`/`last_checksum`, its last answer, which the status holds for a few misses), `token_rejected`
  when it answers 401. A
  `POST /weights/update` the worker refused on an earlier pass goes into `update_failure` (the worker does not report
  it in `/state`) until a later update of that rank succeeds or the spec names other weights.
- `children`: `observed.observe_child` of each Service, Secret and NetworkPolicy that exists; the model's own token
  Secret goes into `damaged` too when it holds no readable token.
- `operator`: the operator's `OperatorConfig.identity()`; `now`: an aware UTC datetime in whole seconds; `fresh_token`:
  a new random token (`secrets.token_urlsafe(32)`), used only if the Secret is missing or damaged.
- `pod_refusals`: for each pod `pods.pods_to_check(input)` lists, what the API server said of a server-side dry-run
  create (spec hash -> its message, for those it refuses), and likewise for a create it refused on an earlier pass.
  The planner neither creates such a pod nor deletes a running one for it, and the model is Degraded
  (`PodTemplateRefused`).

Expert parallelism (`groups.py`, `group_status.py`): `groups` is, per replica, the last epoch this process sent with
its answers (`SentEpoch`; empty after a restart), and each rank's observation says for how long its `/state` has been
silent (`silent_for_s`). The planner sends the next epoch (ReconfigureGroup), deletes the pods of failed ranks that
still run, flips the `tidal.dev/serving` label (SetServingLabel) and writes each group's status.

Executing `Plan.actions`: in phases, not in list order.
0. ReconfigureGroup: `POST /group/reconfigure` to every member at once, each call on its own, started before anything
   else and not waited for by the pass; the answers go into the model's memory (the next pass's `groups`).
1. Children: CreateSecret, CreateService, CreateNetworkPolicy (409 AlreadyExists is fine) and PatchSecret,
   PatchService, PatchNetworkPolicy (merge patch with the manifest), one after another, so the Secret exists (and
   holds a token) before any pod that mounts it. Then every CreatePod, DeletePod (404 is fine) and SetServingLabel
   at once.
2. PatchStatus (a merge patch of the status subresource: top-level nulls remove cleared fields such as
   weightsRollout; inside lists, which a merge patch replaces whole, unset fields are left out), then each EmitEvent
   as an Event on the model. This comes before the worker calls, which may run for minutes: meanwhile the status this
   plan computed ("Updating", "WakingUp") is the true one.
3. SleepRank (`POST /sleep {level}`), WakeRank (`POST /wake_up {}`) and UpdateWeights (`POST /weights/update`), all
   at once. All ranks of one replica come in the same plan, and the executor waits for every answer before the next
   pass (the maxUnavailable budget assumes no update is still running). A failed call becomes a Warning Event; one
   answered "not now" (busy, draining, unreachable) is asked again on a later pass.
A failed Kubernetes write ends the pass, except a CreatePod the API server refuses (remembered for `pod_refusals`);
the next pass plans again from what it observes. Never log `CreateSecret.manifest` or `PatchSecret.manifest`;
`describe()` of every action is safe to log, and the executor logs one line per action.
"""
