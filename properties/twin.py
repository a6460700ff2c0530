"""Property 6's twin: the same events on a second target set to ``settled``.

At depth 1 nothing is ever in flight when a manager frees, so every policy
must free exactly what ``settled`` frees (DESIGN.md, property 6). The runner
(the state machine and ``replay``) feeds each event to a twin reset with the
same config under ``settled``, and the first difference is the violation:

* a configurable target (the reference): a second instance of it;
  :func:`properties.invariants.compare_twin` compares everything observed
  (steps, tables, allocations, frees, counters) (witness ``twin_compared``);
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
  or cannot take an event vLLM took;
* a fixed-policy config the reference does not run or schedule alike (on
  vLLM a Mamba group, whose align mode splits prefills at block edges, or an
  EAGLE / MTP drafter; ``sglang@VERSION`` without its radix tree): :class:`SettledRule`,
  the settled freeing rule over the target's own steps (witness
  ``twin_rule``). No twin (witness ``twin_none``) where SGLang's full
  attention lets go of nothing before a request ends, or its radix tree
  (prefix caching on) keeps a page-rounded window and the pages it caches,
  which the rule does not mirror.

Measured with ``scripts/diff_sweep.py --depth 1 --compare letgo`` (README,
property 6: 1,272 traces, 47,335 events compared): on unmodified vLLM 0.25.1
and 0.33.0, every kind vLLM runs but Mamba, with and without prefix caching,
drafts, preemption and failed loads, no event let go of different blocks
while the steps agreed.
"""

from __future__ import annotations

from impl.target import Target, Unsupported, make_target
from model.events import AddRequest, Config, Event, Group
from model.observations import (
    AllocObs,
    FinishObs,
    FreeObs,
    MoveObs,
    Observed,
    ProcessObs,
    StepObs,
)
from model.policy import Counts, basis
from properties.invariants import Checker, Violation, compare_letgo, compare_twin, twin_config


class SettledRule:
    """Property 6 where no reference twin mirrors a fixed-policy target at
    depth 1: the settled freeing rule applied to the target's own steps.

    At depth 1 nothing is in flight when a step is scheduled, so the settled
    count of a request is its count ``n`` there (a step's start; between its
    steps, its last reported ``computed``), and settled frees, in each group,
    exactly the blocks no position ``>= n`` reads (the kind's ``skipped(n)``,
    vLLM's ``get_num_skipped_tokens``: retained MTP tokens kept)::

        n = 9, sliding(W=4), B = 4   [ 0..3 | 4..7 | 8.. ]
                                        let go  held   step reads [6, ...]

    Two things must hold at every event (where it differs: a violation):

    * *not late*: a step is scheduled with no live block in a slot settled
      lets go of at its start (``freeable(n)``): the block is let go by then,
      at that event or before;
    * *not early*: an out-of-window free lets go of a slot in
      ``freeable(n)`` only (a request ending in the event counts as ending).

    The count handed to the rule is the target's own policy's at depth 1
    (``model.policy.basis`` with nothing in flight): ``settled`` and
    ``optimistic`` are ``n`` (vLLM), ``sglang`` is ``n - 1`` (SGLang's
    ``seqlen - 1 - W``; against plain ``settled`` it frees one token later
    by design, docs/ENGINES.md). What the rule does not mirror is compared in
    one direction only: SGLang's first decode after an extend evicts nothing
    (``decode_batch_idx >= 1``, a guard of its overlap loop that the normal
    loop keeps): no *not late* there; vLLM's Mamba align mode relocates a
    speculative block (a move, no free) and holds ``K`` speculative slots
    past the running state (above ``freeable(n)``, never judged); physical
    ids, allocations, prefix-cache hits and scheduling are not compared."""

    def __init__(self, cfg: Config, policy: str) -> None:
        self.policy = policy
        self.groups = [(gi, g, B) for gi, (g, B) in
                       enumerate(zip(cfg.groups, cfg.block_sizes, strict=True))
                       if g.spec.frees_early]
        self.count: dict[str, int] = {}  # each request's count before the event
        self.known: dict[str, int] = {}  # prompt plus tokens sampled
        self.last: dict[str, str] = {}  # its last step: "middle" | "extend" | "decode"
        self.sampling: dict[int, dict[str, bool]] = {}  # step -> rid -> its step samples
        # the slots each request holds a block in, per group, from the allocations,
        # frees and moves observed (a worker's table, which vLLM appends to, may
        # still list a block let go)
        self.held: dict[tuple[str, int], set[int]] = {}

    def _freeable(self, g: Group, n: int, B: int) -> range:
        return range(g.spec.skipped(basis(self.policy, g, Counts(computed=n))) // B)

    def check(self, ev: Event, obs: Observed, checker: Checker,
              event_index: int) -> Violation | None:
        if type(ev) is AddRequest:
            self.known[ev.id] = ev.prompt_len
        ends = {it.rid for it in obs.items if type(it) is FinishObs
                or (type(it) is FreeObs and it.reason in ("finish", "abort"))}
        steps = {r.rid: r for it in obs.items if type(it) is StepObs for r in it.reqs}
        found: Violation | None = None
        compared = False
        for f in obs.items:
            if type(f) is not FreeObs or f.reason != "window" or f.rid in ends:
                continue
            for gi, g, B in self.groups:
                if gi != f.group:
                    continue
                compared = True
                n = steps[f.rid].start if f.rid in steps else self.count.get(f.rid, 0)
                if f.logical not in self._freeable(g, n, B) and found is None:
                    found = Violation(
                        6, f"at depth 1, {type(ev).__name__}: {f.rid} lets go of its logical "
                           f"block {f.logical} (group {gi}, out of window, block {f.block}) "
                           f"at count {n}, where the settled rule keeps it (it lets go of "
                           f"slots below {len(self._freeable(g, n, B))} only)",
                        rid=f.rid, block=f.block, event_index=event_index)
        for it in obs.items:
            t = type(it)
            if t is AllocObs:
                self.held.setdefault((it.rid, it.group), set()).add(it.logical)
            elif t is FreeObs and it.reason != "copy":  # a copy's hold is no slot of it
                self.held.get((it.rid, it.group), set()).discard(it.logical)
            elif t is MoveObs:
                slots = self.held.setdefault((it.rid, it.group), set())
                slots.discard(it.logical)
                slots.add(it.to)
            if t is ProcessObs:
                for rid, samples in self.sampling.pop(it.step, {}).items():
                    if samples and rid not in it.discarded and rid in self.known:
                        self.known[rid] += 1
            if t is FreeObs and it.reason == "preempt":
                self.last.pop(it.rid, None)  # back to the queue: it extends again
            if t is not StepObs:
                continue
            for r in it.reqs:
                known = self.known.get(r.rid, r.end)
                kind = "decode" if self.last.get(r.rid) in ("extend", "decode") else \
                    "extend" if r.end >= known else "middle"
                first_decode = kind == "decode" and self.last.get(r.rid) == "extend"
                self.last[r.rid] = kind
                self.sampling.setdefault(it.step, {})[r.rid] = r.end >= known
                if self.policy == "sglang" and first_decode:
                    continue
                for gi, g, B in self.groups:
                    compared = True
                    slots = self.held.get((r.rid, gi), set())
                    held = sorted(i for i in slots if i in self._freeable(g, r.start, B))
                    if held and found is None:
                        table = r.tables[gi] if gi < len(r.tables) else ()
                        block = table[held[0]] if held[0] < len(table) else None
                        found = Violation(
                            6, f"at depth 1, step {it.step}: {r.rid} computes "
                               f"[{r.start}, {r.end}) still holding its logical block "
                               f"{held[0]} (group {gi}, block {block}), which the settled "
                               f"rule lets go of before that step (no position >= "
                               f"{r.start} reads it)",
                            step=it.step, rid=r.rid, block=block, event_index=event_index)
        if obs.counters is not None:
            for rid, rc in obs.counters.reqs.items():
                if rc.status == "finished":
                    self.count.pop(rid, None)
                    for gi, _, _ in self.groups:
                        self.held.pop((rid, gi), None)
                else:
                    self.count[rid] = rc.computed
        if compared:
            checker.witness["twin_rule"] += 1
        return found


class Twin:
    def __init__(self, target: Target, cfg: Config) -> None:
        self.policy = cfg.policy
        self.name = target.name
        fixed = target.capabilities.fixed_policy
        self.fixed = fixed is not None
        self.target: Target | None = None
        self.rule: SettledRule | None = None
        self.parted: str | None = None  # why a reference twin of a vLLM stopped
        self.none = False  # depth 1, and no twin models this config exactly
        # the witness a run of this config must reach (None: no twin)
        self.witness: str | None = None
        tc = twin_config(cfg, fixed)
        if fixed and not target.name.startswith("vllm@"):
            tc = None  # the reference twin is measured beside vLLM's Scheduler only
        if tc is not None:
            self.target = make_target("reference" if self.fixed else target.name)
            try:
                self.target.reset(tc)
                self.witness = "twin_compared"
                return
            except Unsupported:  # e.g. an EAGLE or MTP drafter: the reference runs n-gram only
                self.target = None
        if fixed is None or cfg.depth != 1:
            return
        # SGLang's radix tree keeps a page-rounded window of its own and the pages
        # it caches (free_swa_out_of_window_slots with prefix sharing): not mirrored
        radix = fixed == "sglang" and cfg.prefix_caching
        if any(g.spec.frees_early for g in cfg.groups) and not radix:
            self.rule, self.witness = SettledRule(cfg, fixed), "twin_rule"
        else:
            self.none = True

    def note(self, checker: Checker) -> None:
        """Count a depth-1 example without a twin (call once per example)."""
        if self.none:
            checker.witness["twin_none"] += 1

    def check(self, ev: Event, obs: Observed, checker: Checker,
              event_index: int) -> Violation | None:
        if self.rule is not None:
            return self.rule.check(ev, obs, checker, event_index)
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
