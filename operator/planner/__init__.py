"""Pure planner: desired spec + observed pods and worker states -> typed actions and the next status.

`plan(PlanInput) -> Plan` is one level-based pass; it calls no API and keeps no state between passes (what must
survive, such as a failed weights version, lives in the status it returns). The layer that runs it (kopf handlers
and an executor) owes it the following.

Observing (build a `PlanInput`):
- `model`: `InferenceModel.model_validate(body)`; the status must be Tidal's alone, so kopf has to keep its
  progress in annotations (`settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()`) and handlers
  must return None (the structural schema prunes anything else in status).
- `pods`: the model's pods (label `tidal.dev/model=<name>`) through `observed.observe_pod`.
- `ranks`: per running pod, `GET /state` (and `GET /weights/checksum` for `checksum`) on `pod_ip:controlPort` with
  the bearer token from the Secret; `state=None` when it does not answer. A failed `POST /weights/update` from the
  previous pass goes into `update_failure` if the worker does not report it itself.
- `children`: `observed.observe_child` of each Service, Secret and NetworkPolicy that exists.
- `operator`: `OperatorConfig.from_env(os.environ).identity()`; `now`: an aware UTC datetime; `fresh_token`: a new
  random token (`secrets.token_urlsafe(32)`), used only if the Secret is missing.

Executing `Plan.actions`, in order:
- Create* (409 AlreadyExists is fine), Patch* (merge patch with the manifest), DeletePod (404 is fine).
- SleepRank / WakeRank: independent; run them concurrently (`POST /sleep {level}`, `POST /wake_up {}`).
- UpdateWeights: all ranks of one replica come together; run them concurrently and wait for every result before
  the next pass (the planner's maxUnavailable budget assumes no update is still running).
- PatchStatus: patch the status subresource with `status.model_dump(mode="json", by_alias=True)`, nulls included,
  so cleared fields (e.g. weightsRollout) are removed. EmitEvent: an Event on the model.
- Never log `CreateSecret.manifest`; `describe()` of every action is safe to log.
"""
