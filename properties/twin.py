"""Property 6's twin: the same events on a second target set to ``settled``.

At depth 1 nothing is ever in flight when a manager frees, so every policy
must free exactly what ``settled`` frees (DESIGN.md, property 6). The runner
(the state machine and ``replay``) feeds each event to a twin of a
configurable target (one whose policy is a knob: the reference) reset with the
same config under ``settled``, and :func:`properties.invariants.compare_twin`
names the first difference. Targets with a fixed policy (vLLM) have no twin.
"""

from __future__ import annotations

from impl.target import Target, make_target
from model.events import Config, Event
from model.observations import Observed
from properties.invariants import Checker, Violation, compare_twin, twin_config


class Twin:
    def __init__(self, target: Target, cfg: Config) -> None:
        self.policy = cfg.policy
        self.target: Target | None = None
        tc = twin_config(cfg)
        if tc is not None and target.capabilities.fixed_policy is None:
            self.target = make_target(target.name)
            self.target.reset(tc)

    def check(self, ev: Event, obs: Observed, checker: Checker,
              event_index: int) -> Violation | None:
        if self.target is None:
            return None
        checker.witness["twin_compared"] += 1
        return compare_twin(ev, obs, self.target.apply(ev), self.policy, event_index)
