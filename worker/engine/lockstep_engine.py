"""AsyncEngine for a rank of an expert-parallel group: the loop steps in lockstep with its group (see `lockstep`).

What changes against the plain loop:
- Each turn begins with the group's step header (one small all-gather). The group steps when some rank has work; a
  rank without work of its own then runs an empty step. An idle group (or one waiting on a paused rank) exchanges a
  header every `idle_poll_s`, so it does not spin, and a rank that gets a request enters the next header at once.
- A collective that fails or misses its deadline marks the link broken: the rank keeps its requests and KV cache,
  keeps admitting (queued) requests, and steps again once the lifecycle offers the next epoch; the step that was in
  flight committed nothing and is scheduled again then (`LLMEngine.group_step`).
- hold() (sleep, weight update) pauses the rank once its own requests are done (drain: once the whole group is idle,
  so that no peer's request waits on this rank's experts): while paused the loop touches no engine state (the
  lifecycle owns it) and only answers headers with `paused`, which stops every rank from stepping, so a peer never
  computes with experts that are being released or rewritten.
- A weights version differing between ranks stops the group from stepping (`lockstep.decide`): a request is never
  answered by two versions' experts.
"""

from __future__ import annotations

import logging

from tidal.worker.engine.async_engine import AsyncEngine, _Delivery, _Inbox
from tidal.worker.engine.group_link import GroupLink
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.lockstep import StepDecision, StepHeader, decide, version_tag
from tidal.worker.group.errors import GroupBrokenError
from tidal.worker.models.moe_decoder import MoeDecoderForCausalLM

log = logging.getLogger(__name__)


class LockstepAsyncEngine(AsyncEngine):
    def __init__(self, engine: LLMEngine, link: GroupLink, weights_version: str | None) -> None:
        super().__init__(engine)
        self.link = link
        self._version_tag = version_tag(weights_version)
        self._paused = False  # held and drained: the lifecycle owns the engine until release()
        self._hold_interrupts = False  # the hold in progress ends running requests instead of draining them
        self._last: StepDecision | None = None  # the last header's decision (None: no header since the last change)

    def set_weights_version(self, version: str | None) -> None:
        """The version this rank serves now (after an update); ranks step together only on one version."""
        self._version_tag = version_tag(version)

    def notify_group_changed(self) -> None:
        """The link has a new epoch to switch to: wake the loop if it waits for one."""
        with self._wake:
            self._last = None
            self._wake.notify()

    def serving_problem(self) -> str | None:
        if self.link.group is not None:
            return None
        broken = self.link.broken
        if broken is None:
            return "expert parallelism: waiting for the group's first epoch (POST /group/reconfigure)"
        return f"expert parallelism: the group broke in epoch {broken.epoch} ({broken.reason}); waiting for the next"

    # ----- holding -----
    def hold(self, timeout_s: float, interrupt_reason: str | None = None) -> bool:
        self._hold_interrupts = interrupt_reason is not None
        return super().hold(timeout_s, interrupt_reason)

    def release(self) -> None:
        with self._wake:
            self._paused = False
        super().release()

    def _pause_if_drained(self, group_idle: bool) -> None:
        """Under `_wake`: a held rank whose own requests are done (and, draining, whose group is idle) pauses."""
        if not self._holding or self._paused or self._engine.has_unfinished_requests():
            return
        if group_idle or self._hold_interrupts:
            self._paused = True
            self._is_idle = True
            self._idle.notify_all()

    # ----- the loop thread -----
    def _mark_broken(self, error: GroupBrokenError) -> None:
        """Stop stepping with the group; the model forgets its comm too, so nothing runs its MoE layers on a group
        that is gone (they refuse until the next epoch is installed)."""
        self.link.mark_broken(error)
        model = self._engine.runner.model
        if isinstance(model, MoeDecoderForCausalLM) and model.expert_parallel is not None:
            model.drop_expert_comm()
        self._last = None

    def _wait_for_turn(self) -> None:
        """Under `_wake`: return when there is something to do this turn."""
        link = self.link
        while not self._stopping:
            has_local = bool(
                self._inbox.aborts or self._interrupt is not None or (self._inbox.new and not self._holding)
            )
            if link.group is None:
                if link.pending is not None and not self._paused:
                    return  # an epoch to switch to (no old group to agree with)
                self._pause_if_drained(group_idle=True)
                if has_local and not self._paused:
                    return
                self._wake.wait()
                continue
            last = self._last
            if last is None or last.step or last.switch or (has_local and not self._paused):
                return
            self._wake.wait(link.idle_poll_s)  # an idle or waiting group: the next header a little later
            return

    def _loop_until_stopped(self) -> None:
        engine = self._engine
        link = self.link
        while True:
            with self._wake:
                self._wait_for_turn()
                stopping = self._stopping
                paused = self._paused and not stopping
                inbox = _Inbox()
                interrupt = None
                if not paused:
                    if self._holding and not stopping:  # queued requests stay queued; aborts still apply
                        inbox, self._inbox.aborts = _Inbox(aborts=self._inbox.aborts), []
                    else:
                        inbox, self._inbox = self._inbox, _Inbox()
                    interrupt, self._interrupt = self._interrupt, None
            if stopping:
                with self._step_lock:
                    self._turn(inbox, True, interrupt)
                link.close()
                return
            if not paused and (inbox.new or inbox.aborts or interrupt is not None):
                with self._step_lock:
                    deliveries = self._take_inbox(inbox, interrupt)
                    self._stats = engine.stats()
                self._deliver_all(deliveries)
            self._group_turn(paused)

    def _group_turn(self, paused: bool) -> None:
        """One header and what it decides: a step, a switch to the next epoch, or nothing."""
        engine, link = self._engine, self.link
        group, pending = link.group, link.pending
        if group is None:
            if pending is not None and not paused:
                with self._step_lock:
                    link.switch(engine)
                self._last = None
            return
        ready = pending.epoch if pending is not None and not paused else 0
        header = StepHeader(not paused and engine.has_unfinished_requests(), paused, self._version_tag, ready)
        try:
            headers = [StepHeader.decode(values) for values in group.all_gather_ints(header.encode())]
        except GroupBrokenError as err:
            self._mark_broken(err)
            return
        next_members = pending.group.members if pending is not None else ()
        decision = decide(headers, group.members, ready, next_members)
        link.waiting_on = decision.waiting_on
        self._last = decision
        if decision.switch:
            with self._step_lock:
                link.switch(engine)
            self._last = None
            return
        if not decision.step:
            with self._wake:
                self._pause_if_drained(decision.group_idle)
            return
        deliveries: list[_Delivery] = []
        with self._step_lock:
            try:
                deliveries += self._route(engine.group_step())
                link.count_step()
            except GroupBrokenError as err:
                self._mark_broken(err)
            except Exception as err:  # a failed step must not leave clients waiting forever
                log.exception("group step failed; failing the requests in flight")
                deliveries += self._route(engine.abort_all(), err)
            self._stats = engine.stats()
        self._deliver_all(deliveries)
