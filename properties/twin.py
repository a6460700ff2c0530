"""Property 6's twin: the same events on a second target set to ``settled``.

At depth 1 nothing is ever in flight when a manager frees, so every policy
must free exactly what ``settled`` frees (DESIGN.md, property 6). The runner
(the state machine and ``replay``) feeds each event to a twin reset with the
same config under ``settled``, and the first difference is the violation:

* a configurable target (the reference): a second instance of it;
  :func:`properties.invariants.compare_twin` compares everything observed
  (steps, tables, allocations, frees, counters);
* a target with a fixed policy (vLLM: ``Scheduler`` at depth 1): the
  reference target; :func:`properties.invariants.compare_letgo` compares what
  both model exactly at depth 1: at each event, the steps scheduled
  (requests, positions, drafts, loaded tokens) and, while those agree, the
  blocks let go (request, group, logical slot, reason; an out-of-window free
  of a request that ends in the same event counts as that end). Physical
  ids, table contents, allocations and counters are not compared (the pools
  hand out blocks in their own order; vLLM 0.25.1 has no in-flight count).
  Where the steps differ, the twin parts and compares nothing more in that
  example (witness ``twin_parted``): a scheduling difference of the two
  managers (docs/DIFFERENCES.md: 0.25.1 pads a one-token admission only beside
  a running request; 0.33.0 keeps sliding-window blocks cached at its
  retention checkpoints only), not a freeing one. It parts too where the
  reference drops a failed load's slots below the window (DIFFERENCES.md, 1),
  or cannot take an event vLLM took. No twin (witness ``twin_none``) for a
  Mamba group (vLLM's align mode schedules other steps from the first one),
  a drafter the reference does not run (EAGLE, MTP), or another fixed-policy
  target (``sglang@VERSION``: the comparison was not measured there, so it
  is not claimed).

Measured with ``scripts/diff_sweep.py --depth 1 --compare letgo`` (README,
property 6: 1,272 traces, 47,335 events compared): on unmodified vLLM 0.25.1
and 0.33.0, every kind vLLM runs but Mamba, with and without prefix caching,
drafts, preemption and failed loads, no event let go of different blocks
while the steps agreed.
"""

from __future__ import annotations

from impl.target import Target, Unsupported, make_target
from model.events import Config, Event
from model.observations import Observed
from properties.invariants import Checker, Violation, compare_letgo, compare_twin, twin_config


class Twin:
    def __init__(self, target: Target, cfg: Config) -> None:
        self.policy = cfg.policy
        self.name = target.name
        self.fixed = target.capabilities.fixed_policy is not None
        self.target: Target | None = None
        self.parted: str | None = None  # why a reference twin of a vLLM stopped
        self.none = False  # depth 1, and no twin models this config exactly
        tc = twin_config(cfg, target.capabilities.fixed_policy)
        if self.fixed and not target.name.startswith("vllm@"):
            tc = None  # the reference twin is measured beside vLLM's Scheduler only
        if tc is None:
            self.none = self.fixed and cfg.depth == 1
            return
        self.target = make_target("reference" if self.fixed else target.name)
        try:
            self.target.reset(tc)
        except Unsupported:  # e.g. an EAGLE or MTP drafter: the reference runs n-gram only
            self.target, self.none = None, True

    def note(self, checker: Checker) -> None:
        """Count a depth-1 example without a twin (call once per example)."""
        if self.none:
            checker.witness["twin_none"] += 1

    def check(self, ev: Event, obs: Observed, checker: Checker,
              event_index: int) -> Violation | None:
        if self.target is None or self.parted is not None:
            return None
        if not self.fixed:
            checker.witness["twin_compared"] += 1
            return compare_twin(ev, obs, self.target.apply(ev), self.policy, event_index)
        if not self.target.can_apply(ev):
            return self._part(checker, f"the reference cannot take {ev}")
        try:
            there = self.target.apply(ev)
        except ValueError as e:  # the reference's guard refused the event
            return self._part(checker, f"the reference refused {ev}: {e}")
        v, why = compare_letgo(ev, obs, there, self.name, event_index)
        if why is not None:
            return self._part(checker, why)
        checker.witness["twin_compared"] += 1
        return v

    def _part(self, checker: Checker, why: str) -> None:
        self.parted = why
        checker.witness["twin_parted"] += 1
        return None
