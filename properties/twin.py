"""Property 6's twin: the same events on a second target set to ``settled``.

At depth 1 nothing is ever in flight when a manager frees, so every policy
must free exactly what ``settled`` frees (docs/DESIGN.md, property 6). The runner
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
  or cannot take an event vLLM took. :class:`SettledRule` runs beside it
  from the first event (witness ``twin_rule``) and judges every event, so
  after a part it judges the rest of the example alone (witness
  ``twin_rule_after_part``): none of those differences changes what vLLM
  frees on a count (retention decides what stays cached, padding and a
  failed load's recovery decide what is scheduled, and the rule judges the
  steps vLLM schedules);
* a fixed-policy config the reference does not run or schedule alike (on
  vLLM a Mamba group, whose align mode splits prefills at block edges, or an
  EAGLE / MTP drafter; ``sglang@VERSION``): the settled freeing rule over
  the target's own steps alone (witness ``twin_rule``), on SGLang's radix
  tree (prefix caching on) :class:`SGLangRadixRule`, its page-rounded window
  over the slots the tree does not own; where a kind lets go of nothing
  before a request ends (SGLang's full attention), no window free at all.

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
    ReqStep,
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
    exactly the blocks no position ``>= n`` reads (the kind's ``freeable``:
    vLLM's ``get_num_skipped_tokens``, retained MTP tokens kept for the whole
    request; R-SWA's gap after the prompt; nothing of a kind that frees
    nothing early, so any window free there is early)::

        n = 9, sliding(W=4), B = 4   [ 0..3 | 4..7 | 8.. ]
                                        let go  held   step reads [6, ...]

    Two things must hold at every event (where it differs: a violation):

    * *not late*: a step is scheduled with no live block in a slot settled
      lets go of at its start (``freeable(n)``): the block is let go by then,
      at that event or before;
    * *not early*: an out-of-window free lets go of a slot in settled's
      ``freeable(n)`` only (a request ending in the event counts as ending):
      a policy that frees later by design may free sooner, down to settled,
      which is safe (SGLang one token sooner is no violation).

    The count handed to the rule is the target's own policy's at depth 1
    (``model.policy.basis`` with nothing in flight): ``settled`` and
    ``optimistic`` are ``n`` (vLLM), ``sglang`` is ``n - 1`` (SGLang's
    ``seqlen - 1 - W``; against plain ``settled`` it frees one token later
    by design, docs/ENGINES.md). vLLM's R-SWA gap ends at ``n - R``
    (``RSWAManager.remove_skipped_blocks``), one token short of the window, by
    design: its count is ``n - 1`` there (``Kind.vllm_frees_behind``); and
    it takes a prefix hit's blocks whole, after letting go of the request's
    skipped blocks, so a resumed request holds the gap blocks its hit brought
    back until its next step (``Kind.vllm_hit_keeps_gap``: judged from then).
    Beside
    a vLLM reference twin the rule is exact on every event vLLM 0.25.1 and
    0.33.0 take at depth 1 (README, property 6: prefix caching with its
    retention checkpoints, 0.25.1's padding, drafts, preemption, failed loads
    and their recovery). What the rule does not mirror is compared in
    one direction only: SGLang's first decode after an extend evicts nothing
    (``decode_batch_idx >= 1``, a guard of its overlap loop that the normal
    loop keeps): no *not late* there; vLLM's Mamba align mode relocates a
    speculative block (a move, no free) and holds ``K`` speculative slots
    past the running state (above ``freeable(n)``, never judged); physical
    ids, allocations, prefix-cache hits and scheduling are not compared."""

    def __init__(self, cfg: Config, policy: str) -> None:
        self.policy = policy
        self.groups = [(gi, g, B) for gi, (g, B) in
                       enumerate(zip(cfg.groups, cfg.block_sizes, strict=True))]
        self.prompt: dict[str, int] = {}
        self.count: dict[str, int] = {}  # each request's count before the event
        self.known: dict[str, int] = {}  # prompt plus tokens sampled
        self.last: dict[str, str] = {}  # its last step: "middle" | "extend" | "decode"
        self.sampling: dict[int, dict[str, bool]] = {}  # step -> rid -> its step samples
        # the slots each request holds a block in, per group, from the allocations,
        # frees and moves observed (a worker's table, which vLLM appends to, may
        # still list a block let go)
        self.held: dict[tuple[str, int], set[int]] = {}
        self.hits: set[tuple[str, int, int]] = set()  # (rid, group, slot) holding a cached block

    def _freeable(self, g: Group, n: int, B: int, rid: str, policy: str | None = None) -> range:
        b = max(0, basis(policy or self.policy, g, Counts(computed=n))
                - g.spec.vllm_frees_behind)
        # a sliding window's retained tokens stay below it for the whole request
        # (vLLM's get_num_skipped_tokens); R-SWA's gap depends on the prompt
        return g.spec.freeable(b, B, None if g.spec.retained else self.prompt.get(rid, 0))

    def _due(self, g: Group, B: int, r: ReqStep, kind: str, last: str | None) -> range | None:
        """The slots of ``g`` that step ``r`` must find let go of (None: not judged)."""
        if self.policy == "sglang" and kind == "decode" and last == "extend":
            return None  # SGLang's first decode after an extend evicts nothing
        return self._freeable(g, r.start, B, r.rid)

    def _stepped(self, r: ReqStep, kind: str, last: str | None) -> None:
        """After step ``r`` was judged (a subclass follows what it protects)."""

    def _kept(self, rid: str, group: int, slot: int) -> bool:
        """A slot the target keeps by design, never judged late."""
        return False

    def _scheduled(self, step: StepObs) -> None:
        """After every request of ``step`` was judged."""

    def _why(self, r: ReqStep) -> str:
        return f"no position >= {r.start} reads it"

    def check(self, ev: Event, obs: Observed, checker: Checker,
              event_index: int) -> Violation | None:
        if type(ev) is AddRequest:
            self.known[ev.id] = self.prompt[ev.id] = ev.prompt_len
        ends = {it.rid for it in obs.items if type(it) is FinishObs
                or (type(it) is FreeObs and it.reason in ("finish", "abort"))}
        steps = {r.rid: r for it in obs.items if type(it) is StepObs for r in it.reqs}
        found: Violation | None = None
        compared = False
        hit_now: set[tuple[str, int, int]] = set()  # slots a prefix hit fills in this event
        for f in obs.items:
            if type(f) is not FreeObs or f.reason != "window" or f.rid in ends:
                continue
            for gi, g, B in self.groups:
                if gi != f.group:
                    continue
                compared = True
                n = steps[f.rid].start if f.rid in steps else self.count.get(f.rid, 0)
                # no earlier than settled: a policy that frees later by design
                # (SGLang's) may free sooner, down to the safe rule
                fr = self._freeable(g, n, B, f.rid, "settled")
                if f.logical not in fr and found is None:
                    found = Violation(
                        6, f"at depth 1, {type(ev).__name__}: {f.rid} lets go of its logical "
                           f"block {f.logical} (group {gi}, out of window, block {f.block}) "
                           f"at count {n}, where the settled rule keeps it (it lets go of "
                           f"slots [{fr.start}, {fr.stop}) only)",
                        rid=f.rid, block=f.block, event_index=event_index)
        for it in obs.items:
            t = type(it)
            if t is AllocObs:
                self.held.setdefault((it.rid, it.group), set()).add(it.logical)
                if it.cached:
                    self.hits.add((it.rid, it.group, it.logical))
                    hit_now.add((it.rid, it.group, it.logical))
                else:
                    self.hits.discard((it.rid, it.group, it.logical))
            elif t is FreeObs and it.reason != "copy":  # a copy's hold is no slot of it
                self.held.get((it.rid, it.group), set()).discard(it.logical)
                self.hits.discard((it.rid, it.group, it.logical))
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
                last = self.last.get(r.rid)
                kind = "decode" if last in ("extend", "decode") else \
                    "extend" if r.end >= known else "middle"
                self.last[r.rid] = kind
                self.sampling.setdefault(it.step, {})[r.rid] = r.end >= known
                due = {gi: self._due(g, B, r, kind, last) for gi, g, B in self.groups}
                self._stepped(r, kind, last)
                for gi, slots_due in due.items():
                    if slots_due is None:
                        continue
                    compared = True
                    slots = self.held.get((r.rid, gi), set())
                    late_hit = self.groups[gi][1].spec.vllm_hit_keeps_gap
                    held = sorted(i for i in slots if i in slots_due
                                  and not self._kept(r.rid, gi, i)
                                  and not (late_hit and (r.rid, gi, i) in hit_now))
                    if held and found is None:
                        table = r.tables[gi] if gi < len(r.tables) else ()
                        block = table[held[0]] if held[0] < len(table) else None
                        found = Violation(
                            6, f"at depth 1, step {it.step}: {r.rid} computes "
                               f"[{r.start}, {r.end}) still holding its logical block "
                               f"{held[0]} (group {gi}, block {block}), which the settled "
                               f"rule lets go of before that step ({self._why(r)})",
                            step=it.step, rid=r.rid, block=block, event_index=event_index,
                            facts={"fact": "frees_later", "rid": r.rid})
            self._scheduled(it)
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



class SGLangRadixRule(SettledRule):
    """Property 6 on SGLang with its radix tree (``--prefix-caching on``):
    the settled rule where SGLang frees a request's own slots, on SGLang's
    own rule there. With prefix sharing SGLang never frees what the tree owns
    (a request's ``[0, cache_protected_len)``: its prefix hit, and what each
    checkpoint inserted), and frees its own slots below a page-rounded window
    (``free_swa_out_of_window_slots``: ``pre - ceil_align(max(W, B), B)``,
    floored to a page)::

        W = 3, B = 2, cpl = 4, pre = 11: CA = ceil_align(max(3, 2), 2) = 4
        slots      [ 0 | 1 | 2 | 3 | 4 | 5 ]      (11 - 4) // 2 = 3
                     tree's  own   own, kept (positions >= 6)
                             freed

    at the checkpoint of each processed prefill chunk (``checkpoint_into_tree``,
    ``pre = end - 1``; then ``cpl`` moves to the chunk's end, page-floored) and
    at each decode after the first (``maybe_evict_swa``, ``pre = seqlen - 1``,
    the step's start). Both directions are judged:

    * *not early*: every window free (the request's own and the tree's LRU
      eviction of SWA pages no lock covers) lets go of a slot the settled
      rule (SGLang's count) frees, as :class:`SettledRule` judges it; SGLang's
      page-rounded window keeps at least ``W`` tokens, so this is exact for
      the request's own frees;
    * *not late*: a step finds every own slot of ``[cpl, (pre - CA) // B)``
      let go of, ``cpl`` taken as the last checkpointed end, page-floored (the
      prefix hit's length after an admission): an upper bound of SGLang's, so
      slots between the two are not judged. Not judged at the first
      checkpoint after an admission once the tree may hold KV (a step ran
      before it): a full-attention match past the SWA pages the tree
      tombstoned leaves a SWA branching point (``swa_branching_seqlen``), and
      that insert stops there (``pre = branch - 1``) and protects the rest.

    A slot that holds a page the tree bound to the row (a prefix hit, an
    insert's dedup, a SWA page the tree restored below the window) is the
    tree's, never judged late. Not mirrored (so not judged late): when the
    tree evicts the SWA pages it owns (LRU under pool pressure), the branch
    point itself, and the second free a SWA branch insert
    makes (``cleanup_after_caching_req``, ``pre = len(fill_ids) - 1``, one
    token further)."""

    def __init__(self, cfg: Config, policy: str) -> None:
        super().__init__(cfg, policy)
        self.protected: dict[str, int] = {}  # rid -> its cache_protected_len, at most
        self.fresh: set[str] = set()  # admitted, its first checkpoint still to come
        self.tree_filled = False  # a step ran before: the tree may hold its KV

    def _due(self, g: Group, B: int, r: ReqStep, kind: str, last: str | None) -> range | None:
        if not g.spec.frees_early:
            return range(0)
        if last is None:  # admitted (again): the tree owns the hit, nothing is its own yet
            return range(0)
        decode = kind == "decode" and last == "decode"
        if not decode and r.rid in self.fresh:
            return None  # the first checkpoint may stop at the hit's SWA branching point
        # the eviction behind this step: a decode's own, else the checkpoint of
        # the step before it (processed, or stashed at this schedule)
        pre = r.start if decode else r.start - 1
        ca = -(-max(g.param, B) // B) * B
        lo = self.protected.get(r.rid, 0) // B
        return range(lo, max(lo, (pre - ca) // B))

    def _stepped(self, r: ReqStep, kind: str, last: str | None) -> None:
        B = self.groups[0][2]
        if last is None:
            self.protected[r.rid] = r.start  # the hit: page-aligned
            if self.tree_filled:  # the tree may hold a longer full-attention match
                self.fresh.add(r.rid)
        elif not (kind == "decode" and last == "decode"):
            self.protected[r.rid] = r.start // B * B  # the step before was checkpointed
            self.fresh.discard(r.rid)

    def _scheduled(self, step: StepObs) -> None:
        self.tree_filled = True

    def _kept(self, rid: str, group: int, slot: int) -> bool:
        return (rid, group, slot) in self.hits  # a page the tree owns and bound to the row

    def _why(self, r: ReqStep) -> str:
        return (f"SGLang's radix rule frees its own slots below the page-rounded window "
                f"of its last eviction before a step from {r.start}")


class Twin:
    def __init__(self, target: Target, cfg: Config) -> None:
        self.policy = cfg.policy
        self.name = target.name
        fixed = target.capabilities.fixed_policy
        self.fixed = fixed is not None
        self.target: Target | None = None
        self.rule: SettledRule | None = None
        self.parted: str | None = None  # why a reference twin of a vLLM stopped
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
                if self.fixed:
                    self.rule = SettledRule(cfg, fixed)
                return
            except Unsupported:  # e.g. an EAGLE or MTP drafter: the reference runs n-gram only
                self.target = None
        if fixed is None or cfg.depth != 1:
            return
        # SGLang's radix tree: a page-rounded window, the pages the tree owns kept;
        # a kind that frees nothing early (full attention): no window free at all
        radix = fixed == "sglang" and cfg.prefix_caching
        self.rule = (SGLangRadixRule if radix else SettledRule)(cfg, fixed)
        self.witness = "twin_rule"

    def check(self, ev: Event, obs: Observed, checker: Checker,
              event_index: int) -> Violation | None:
        # the rule sees every event (its held slots and counts are built from the
        # first one); beside a reference twin it is a second judge, alone after a part
        ruled = None if self.rule is None else self.rule.check(ev, obs, checker, event_index)
        if self.target is None or self.parted is not None:
            return ruled
        if not self.fixed:
            checker.witness["twin_compared"] += 1
            return compare_twin(ev, obs, self.target.apply(ev), self.policy, event_index)
        if not self.target.can_apply(ev):
            self._part(checker, f"the reference cannot take {ev}")
            return ruled
        try:
            there = self.target.apply(ev)
        except ValueError as e:  # the reference's guard refused the event
            self._part(checker, f"the reference refused {ev}: {e}")
            return ruled
        v, why = compare_letgo(ev, obs, there, self.name, event_index)
        if why is not None:
            self._part(checker, why)
            return ruled
        checker.witness["twin_compared"] += 1
        return v or ruled

    def _part(self, checker: Checker, why: str) -> None:
        self.parted = why
        checker.witness["twin_parted"] += 1
        if self.rule is not None:  # it judges the events after the part
            checker.witness["twin_rule_after_part"] += 1
