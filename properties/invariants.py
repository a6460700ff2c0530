"""The properties of docs/DESIGN.md as checks over observations.

A :class:`Checker` is fed, event by event, what a target reported
(:class:`model.observations.Observed`) and keeps a shadow of what matters:
the unprocessed steps with the tables they were scheduled with, each
request's settled count ``p``, who holds which block. It returns
:class:`Violation` s, each naming the property, the step, the request, the
block and the positions, in one line.

1. ``freed-while-read``: a block returned while an unprocessed step may still
   read it, or (out-of-window frees) that a rollback could make needed again;
2. ``null-read``: a step's window, through its table, hits NULL or a block
   the request does not hold, or positions of a block whose KV never arrived
   (a failed connector load, from the block the FailLoad event names, and
   everything the request computed after it) that nothing computed again
   before the step reads them, whoever reads them (a prefix-cache hit too);
   and the output of a step that read such positions before the failure was
   known must not count;
3. ``pool-accounting``: free + owned + NULL = total, no double free, no leak;
4. ``in-flight-accounting``: ``f`` equals the unprocessed steps' tokens and
   ``c = p + f + loading``; ``f = 0`` when idle;
5. ``admission-bound``: live blocks per request within the manager's bound;
6. ``sync-unchanged``: at depth 1 a policy behaves exactly like ``settled``:
   the runner feeds the same events to a twin set to ``settled`` (the same
   configurable target, or the reference beside a vLLM) and
   :func:`compare_twin` / :func:`compare_letgo` find the first difference;
   where no reference twin runs (vLLM's Mamba, EAGLE, MTP; SGLang without its radix tree) the
   settled freeing rule over the target's own steps judges each event
   (:class:`properties.twin.SettledRule`);
7. ``progress``: a preemption inside ``schedule()`` lets go of something in
   that step (a victim whose blocks all wait behind in-flight steps frees
   nothing the scheduler can use, and the next victim follows); and, checked
   by the state machine's drain (:mod:`properties.machine`), with no new
   requests and no failures every request finishes within a stated bound of
   scheduler iterations.

Witnesses count how often a run reached the situations these are about.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from model.events import AddRequest, Config, Event, FailLoad, Group, Schedule
from model.mamba_slots import checkpoint_copy, running_slot, start_slot, worker_slots, written
from model.observations import (
    NULL,
    AllocObs,
    CopyObs,
    FinishObs,
    FreeObs,
    MoveObs,
    Observed,
    ProcessObs,
    ReqStep,
    StepObs,
)
from model.tokens import describe_key, key_position, prefix_key
from model.windows import (
    cached_reads,
    freeable_blocks,
    live_bound,
    read_blocks,
    reads,
    skipped,
)

PROPERTIES = {
    1: "freed-while-read",
    2: "null-read",
    3: "pool-accounting",
    4: "in-flight-accounting",
    5: "admission-bound",
    6: "sync-unchanged",
    7: "progress",
}

WITNESSES = {
    "window_free": "a block returned to the pool because it left the window",
    "free_while_in_flight": "a window free while another step of the request was in flight",
    "rollback_near_free": "a draft rejection in a request with freed (NULL) slots",
    "draft_rejected": "a processed step whose request accepted fewer drafts than it had",
    "preempt_in_flight": "a preemption with steps of the request in flight",
    "failed_load": "a failed connector load, recomputed",
    "failed_load_in_flight": "a failed load with another step of the request in flight",
    "block_reused": "a block handed to a request after another request let it go",
    "prefix_hit": "a prefix-cache hit on a block another request wrote",
    "fine_grained_hit": "a prefix-cache hit on a block longer than the hash unit (its key the "
                        "chained hash of its last unit: groups of different block sizes)",
    "partial_hit": "a prefix-cache hit ending inside a block, served from a private copy of "
                   "it (copy-on-write: prefix_match_unit below a Mamba group's block)",
    "partial_tail_copied": "a Mamba state at a prompt's last hash boundary copied out before "
                           "the request's next step overwrites it",
    "free_read_in_flight": "a window free of a block an unprocessed step still reads (stream-"
                           "ordered engines: harmless under hazard ordered, property 1's "
                           "under unordered)",
    "cache_evicted": "a block the prefix cache kept, handed out afresh (evicted)",
    "window_edge_crossing": "a window edge crossing a block edge (a block became freeable)",
    "window_free_at_edge": "an out-of-window free of a block ending within a token of the "
                           "first position still read (a threshold a token or two off frees "
                           "a block still read here)",
    "pool_drained": "every free block handed out (a pool that leaked reserved blocks would "
                    "hand them out here)",
    "preempt_in_schedule": "schedule() preempted a request under pool pressure",
    "drained": "an example ended with every request run to completion (property 7)",
    "twin_compared": "an event compared with a settled twin at depth 1 (property 6)",
    "twin_parted": "an example where a vLLM target and its reference twin scheduled different "
                   "steps, or the twin could not take an event: the twin compared the "
                   "events before it only",
    "twin_rule_after_part": "an example whose reference twin parted and whose later events "
                            "the settled rule, run beside the twin from the first event, "
                            "judged to the example's end (property 6)",
    "twin_rule": "an event of a depth-1 fixed-policy target whose steps or frees were "
                 "compared with the settled freeing rule (property 6; beside vLLM's reference "
                 "twin, or alone: vLLM's Mamba, EAGLE, MTP; SGLang, its radix tree too)",
    "kept_in_flight": "a step read a ring's or the encoder's blocks past its request's "
                      "first block with another of its steps in flight (what a window "
                      "manager would have freed there)",
    "state_block_moved": "a Mamba speculative state block relocated past the new running state",
    "checkpoint_near_rejection": "a draft rejection rolling a Mamba request back below the "
                                 "block edge whose state its step checkpointed",
    "reprefill_reach": "a prefill chunk whose drafter computes the last chunk's positions again "
                       "and so reads a block below its own window (retained tokens)",
}


@dataclass(frozen=True)
class Violation:
    prop: int
    message: str
    step: int | None = None
    rid: str | None = None
    block: int | None = None
    event_index: int | None = None
    # what the violation is in terms of the target's own state, for a test
    # that asserts on it (impl/vllm/export.py): {"fact": ..., "rid", "group",
    # "logical", "step", ...}; None where no such statement is made
    facts: dict | None = None

    @property
    def name(self) -> str:
        return PROPERTIES[self.prop]

    def __str__(self) -> str:
        return f"property {self.prop} ({self.name}): {self.message}"


@dataclass
class _Pending:
    """One request's part of an unprocessed step, as the checker sees it."""

    step: int
    rs: ReqStep
    shift: int = 0  # positions it computes moved down by rejections of earlier steps
    dead: bool = False  # output will be discarded (preempted / failed / ended)
    # what it read that a failed load left without KV (block, logical, [x, y)):
    # its output must not count
    tainted: tuple[int, int, int, int] | None = None
    lead: int = 0  # positions below its start it computes again (Kind.reprefill)
    # Mamba groups: the request's step before it (the states it starts from),
    # and, once that one is processed, the drafts it accepted
    prev: _Pending | None = None
    acc: int | None = None

    @property
    def start(self) -> int:
        return self.rs.start - self.shift

    @property
    def reads_from(self) -> int:
        """The lowest position whose window it reads: its start, or the start
        of the positions a lagging drafter computes again."""
        return self.rs.start - self.shift - self.lead

    @property
    def end(self) -> int:
        return self.rs.end - self.shift


@dataclass
class _Req:
    order: int = 0  # when the checker first heard of it: the order requests are judged in
    p: int | None = None  # settled count; None until first scheduled
    ended: bool = False
    deferred: list[FreeObs] = field(default_factory=list)
    window_freed: int = 0
    last_freeable: dict[int, int] = field(default_factory=dict)
    stopped: bool = False  # preempted / waiting since the last time it ran
    loaded: tuple[int, int] | None = None  # positions its last connector load covers
    chunk: tuple[int, int] | None = None  # its last scheduled step's positions, while running
    last_part: _Pending | None = None  # its last scheduled step, while running (Mamba)


class _Reqs(dict[str, _Req]):
    """rid -> :class:`_Req`, made on first use; each knows its place in the
    order requests were first named (violations of one event are reported in
    it, whichever requests the event touched)."""

    def __init__(self) -> None:
        super().__init__()
        self._n = 0

    def __missing__(self, rid: str) -> _Req:
        r = self[rid] = _Req(order=self._n)
        self._n += 1
        return r


class _Holder(dict[tuple[str, int, int], int]):
    """(rid, group, logical) -> block, with each request's keys at hand (in the
    order they were set), so what a request holds is found without a scan."""

    def __init__(self) -> None:
        super().__init__()
        self.by_rid: dict[str, dict[tuple[str, int, int], None]] = {}

    def __setitem__(self, key: tuple[str, int, int], block: int) -> None:
        if key not in self:
            keys = self.by_rid.get(key[0])
            if keys is None:
                keys = self.by_rid[key[0]] = {}
            keys[key] = None
        super().__setitem__(key, block)

    def __delitem__(self, key: tuple[str, int, int]) -> None:
        super().__delitem__(key)
        keys = self.by_rid[key[0]]
        del keys[key]
        if not keys:
            del self.by_rid[key[0]]

    def pop(self, key, *default):  # type: ignore[override]
        if key not in self:
            return super().pop(key, *default)
        block = self[key]
        del self[key]
        return block

    def of(self, rid: str) -> list[tuple[str, int, int]]:
        """The keys ``rid`` holds, in the order they were set."""
        return list(self.by_rid.get(rid, ()))


def twin_config(cfg: Config, fixed_policy: str | None = None) -> Config | None:
    """The config of property 6's twin: the same at depth 1 under ``settled``
    (None: nothing to compare: async, or a configurable target's config is
    settled already). ``fixed_policy``: the target implements one policy (a
    vLLM); its twin is the reference target, and None where the reference does
    not model the config exactly: a Mamba group (vLLM's align mode splits
    prefills at block edges and keeps a chunk's last state only; the two
    schedule different steps from the first one, docs/DIFFERENCES.md)."""
    if cfg.depth != 1:
        return None
    if fixed_policy is None:
        return None if cfg.policy == "settled" else replace(cfg, policy="settled")
    if any(g.spec.holds_state for g in cfg.groups):
        return None
    return replace(cfg, policy="settled")


def compare_twin(ev: Event, mine: Observed, twin: Observed, policy: str,
                 event_index: int) -> Violation | None:
    """Property 6: what one event did under ``policy`` and under ``settled``
    at depth 1 (the same target, the same events) must be the same."""
    if mine.items == twin.items and mine.counters == twin.counters:
        return None
    a, b = list(mine.items), list(twin.items)
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
             min(len(a), len(b)))
    here = a[i] if i < len(a) else "nothing"
    there = b[i] if i < len(b) else "nothing"
    if here == there:
        here, there = mine.counters, twin.counters
    return Violation(6, f"at depth 1 {policy} and settled part at {type(ev).__name__}: "
                        f"{policy} gives {here}, settled gives {there}",
                     event_index=event_index)


def _shares(obs: Observed) -> list[tuple[str, int, int, int, int]]:
    """The steps an event scheduled, as (request, start, end, drafts, loaded)."""
    return sorted((r.rid, r.start, r.end, r.spec, r.loaded)
                  for it in obs.items if type(it) is StepObs for r in it.reqs)


def _letgo(obs: Observed) -> list[tuple[str, int, int, str]]:
    """The blocks an event let go, as (request, group, logical slot, reason);
    every block of a request that ends in the event (a FinishObs, or a finish
    or abort free) as ``end``, its out-of-window frees included, and the
    out-of-window frees of a request preempted in it as ``preempt``: vLLM
    0.25.1's connector finish frees an ending request's blocks below the
    window of its optimistic count as window frees first, some or all of
    them, the same blocks in the same event (docs/DIFFERENCES.md, 4 D and E)."""
    ends: dict[str, str] = {}
    for it in obs.items:
        if type(it) is FinishObs or (type(it) is FreeObs and it.reason in ("finish", "abort")):
            ends[it.rid] = "end"
        elif type(it) is FreeObs and it.reason == "preempt":
            ends.setdefault(it.rid, "preempt")
    return sorted((f.rid, f.group, f.logical,
                   ends.get(f.rid, f.reason) if f.reason in ("window", "finish", "abort")
                   else f.reason)
                  for f in obs.items if type(f) is FreeObs)


def compare_letgo(ev: Event, mine: Observed, twin: Observed, target: str,
                  event_index: int) -> tuple[Violation | None, str | None]:
    """Property 6 on a target with a fixed policy (vLLM) beside the reference
    under ``settled``, at depth 1, on what both model exactly: while the two
    schedule the same steps (requests, positions, drafts, loaded tokens), each
    event must let go of the same blocks (request, group, logical slot; a
    window free or the end of the request). Returns (violation, why the twin
    parts): where the steps differ (a scheduling difference of the two
    managers, docs/DIFFERENCES.md, not a freeing one), the reference drops
    slots of a failed load below the window (DIFFERENCES.md, 1: vLLM frees
    nothing there) or the target restarts a request whose load failed (a
    recovery of a fixed tree) the twin stops, with no verdict."""
    a, b = _shares(mine), _shares(twin)
    if a != b:
        return None, f"the steps differ at {type(ev).__name__}: {target} {a}, settled {b}"
    if any(type(f) is FreeObs and f.reason == "failed_load" for f in twin.items):
        return None, "the reference drops a failed load's slots below the window"
    failed = {r for p in mine.items if type(p) is ProcessObs for r, _ in p.failed}
    if any(type(f) is FreeObs and f.rid in failed and f.reason == "preempt" for f in mine.items):
        # a fixed tree's recovery (findings/fixes/): the request restarts as
        # preempted where the reference recomputes into the blocks it holds
        return None, f"{target} restarts a request whose load failed"
    x, y = _letgo(mine), _letgo(twin)
    if x == y:
        return None, None
    extra, missing = sorted((Counter(x) - Counter(y)).elements()), \
        sorted((Counter(y) - Counter(x)).elements())
    rid, group, logical, why = (extra or missing)[0]
    block = next((f.block for f in mine.items if type(f) is FreeObs and f.rid == rid
                  and f.group == group and f.logical == logical), None)
    what = "out of window" if why == "window" else why
    side = (f"{target} lets go of {rid}'s logical block {logical} (group {group}, {what}) "
            f"and the settled reference does not" if extra else
            f"the settled reference lets go of {rid}'s logical block {logical} "
            f"(group {group}, {what}) and {target} does not")
    return Violation(6, f"at depth 1, {type(ev).__name__}: {side} (it lets go of "
                        f"{x or 'nothing'}, settled of {y or 'nothing'})",
                     rid=rid, block=block, event_index=event_index,
                     facts=None if extra else {"fact": "frees_later", "rid": rid}), None


def expected_witnesses(cfg: Config) -> set[str]:
    """The witnesses a run of this config family can reach."""
    local = any(g.spec.frees_early for g in cfg.groups)
    out = {"block_reused"}
    if any(g.spec.reserved_blocks(cfg.block_size) for g in cfg.groups):
        out.add("pool_drained")
    if local:
        out.add("window_edge_crossing")
        out.add("window_free")
    if any(g.kind == "sliding" for g in cfg.groups) and not cfg.prefix_caching:
        # (SGLang's radix tree keeps a page-rounded window: a token more)
        out.add("window_free_at_edge")
    if cfg.depth >= 2 and local:
        out.add("free_while_in_flight")
    if cfg.spec_tokens and local:
        out.add("rollback_near_free")
    if cfg.depth >= 2:
        out.add("preempt_in_flight")
    if cfg.depth >= 2 and any(not g.spec.reads_positions for g in cfg.groups):
        out.add("kept_in_flight")
    if cfg.prefix_caching:
        out.add("prefix_hit")
        if max(cfg.block_sizes) > cfg.hash_block_size:
            out.add("fine_grained_hit")
        if cfg.partial_hits:
            out.add("partial_hit")
    if cfg.stream_ordered and cfg.prefix_caching:
        out.add("cache_evicted")
        if cfg.depth >= 2 and local:
            out.add("free_read_in_flight")
    if any(g.spec.reprefill() for g in cfg.groups):
        out.add("reprefill_reach")
    if cfg.spec_tokens and any(g.spec.holds_state for g in cfg.groups):
        out.add("checkpoint_near_rejection")
    return out


class Checker:
    """Checks one run, fed event by event (:meth:`feed`). ``content=False``
    keeps no slot contents (property 2's content rule is not judged): for a
    shadow that only follows a run already checked, as the report's does."""

    def __init__(self, cfg: Config, content: bool = True):
        self.cfg = cfg
        # out-of-window frees behind one ordered forward stream, no unordered writer
        self._stream_ordered = cfg.stream_ordered and cfg.hazard == "ordered"
        self.B = cfg.block_size  # the unit of FailLoad's first_bad_block
        self.Bs = cfg.block_sizes  # per group: tokens per logical block
        self._fine = tuple(b > cfg.hash_block_size for b in self.Bs) if cfg.prefix_caching \
            else (False,) * len(self.Bs)
        self.pending: list[list[_Pending]] = []  # unprocessed steps, oldest first
        self.pending_ids: list[int] = []
        # rid -> its parts of the unprocessed steps (dead ones too), oldest first
        self._parts: dict[str, list[_Pending]] = {}
        # per request until it is retired (:meth:`_retire`: it ended, and no step
        # in flight, block, or deferred free names it any more)
        self.reqs: dict[str, _Req] = _Reqs()
        self.holder: dict[tuple[str, int, int], int] = _Holder()  # (rid, group, logical) -> block
        # The counters each live request was last listed with (an event lists
        # only those it may have changed), those reporting tokens in flight,
        # and the requests whose expected counts this event changed (a part
        # scheduled, processed or marked dead, its settled count moved): the
        # requests judged at an event are those listed and those touched, so
        # an event costs what it touches, not what is live.
        self._last: dict[str, object] = {}
        self._busy: set[str] = set()
        self._touched: set[str] = set()
        self._retired_now: set[str] = set()
        self._nheld: Counter[str] = Counter()  # rid -> its holder and detached entries
        self._ending: set[str] = set()  # ended, not yet retired
        self.refs: Counter[int] = Counter()  # block -> references held
        self._owned = 0  # blocks with refs > 0, kept in step with self.refs
        self._deferring: set[str] = set()  # requests with window frees judged later
        self._scheduling = False  # the event being fed is a Schedule
        self._let_go: set[str] = set()
        self.last_owner: dict[int, str] = {}
        self.witness: Counter[str] = Counter()
        self.event_index = -1
        self.violations: list[Violation] = []
        self.failing: set[str] = set()  # requests with a FailLoad pending
        self.fail_from: dict[str, int] = {}  # rid -> first bad block, from the FailLoad events
        # block -> positions [x, y) it holds without valid KV (a failed load), until
        # a later step writes them again or the block is handed out afresh
        self.bad: dict[int, tuple[int, int]] = {}
        self.detached: Counter[tuple[str, int, int, int]] = Counter()
        # copies not yet run or not yet processed: [CopyObs, the step that runs
        # it (None until the next step is scheduled)]; (rid, group, block) ->
        # references a copy of rid's holds
        self._copies: list[list] = []
        self.copy_held: Counter[tuple[str, int, int]] = Counter()
        self._early_copy_frees: list[tuple[int, list]] = []  # (block, copy record)
        self._copy_group: dict[tuple[int, int], int] = {}  # queued copy -> its group
        # a copy's destination that got nothing -> (its source, whether another
        # copy of the same step was to fill that source)
        self._unfilled: dict[int, tuple[int, bool, str | None]] = {}
        # What every slot of a block holds: per offset, ``(key, step, rid)`` of
        # the KV a step (or a connector load) wrote there for the token prefix
        # ``key`` (model.tokens), or a string saying why it holds no valid KV.
        # A block handed out afresh holds nothing; a prefix hit keeps what the
        # block holds. Attention groups only (a Mamba block holds one state).
        self.content: dict[int, list] = {}
        self._ver: dict[int, int] = {}  # block -> how often its content changed
        # request ("" for the sink) -> (block, logical slot) -> (version, first,
        # end offset) found good; the slot matters: the same block read at
        # another slot names other positions
        self._ok: dict[str, dict[tuple[int, int | None], tuple[int, int, int]]] = {}
        self.prompt_len: dict[str, int] = {}
        self.variant: dict[str, int] = {}  # prompt variants other than 0
        self._kv_groups = tuple(gi for gi, g in enumerate(cfg.groups)
                                if not g.spec.holds_state and g.spec.reads_positions
                                and content)
        # groups read whole by every step and held to the request's end (ring, cross)
        self._held_groups = tuple(gi for gi, g in enumerate(cfg.groups)
                                  if not g.spec.reads_positions)
        # EAGLE's draft layer shares group 0, or has a group of its own beside a
        # hybrid or Mamba model's (Config.draft_group); its KV at a prompt position q is
        # built from q's hidden state and token q + 1, so it is valid only for
        # requests that also agree on the next token (what vLLM's hit drop and
        # lookahead hashes are for). Past the prompt, tokens are the request's
        # own outputs and drafts: keyed by position as in every other group.
        self._lookahead_group = cfg.draft_group
        # positions a step continuing a prefill computes again (a multi-module
        # MTP drafter's retained tokens), the most over the groups
        self._reprefill = max(g.spec.reprefill() for g in cfg.groups)
        self._mamba = any(g.spec.holds_state for g in cfg.groups)
        # Mamba states in the worker's slots (vLLM's align mode, prefix caching
        # on: the running state after a step's last accepted token in slot
        # (end - 1) // B, one slot per draft, :meth:`_state_slot`); without
        # prefix caching a state lives in the block of its position (the
        # reference's block-sized states, as the attention replay has them)
        self._slots = worker_slots(cfg)
        # rid -> (group, slot) -> the block relocated away from that slot in the
        # request's current worker row (MoveObs), which the worker still names there
        self._moved: dict[str, dict[tuple[int, int], int]] = {}
        # blocks a kind keeps for itself: the static sink's, holding its KV from the start
        self.reserved = tuple(b for g in cfg.groups for b in g.spec.reserved_blocks(self.B))
        for b in self.reserved:
            self.content[b] = [(("sink", (b - 1) * self.B + o), -1, "sink")
                               for o in range(self.B)]
        self._bound_default = tuple(
            live_bound(g, B, cfg.max_model_len, cfg.depth * cfg.max_num_batched_tokens)
            for g, B in zip(cfg.groups, self.Bs, strict=True)
        )

    # ------------------------------------------------------------ public

    def feed(self, event: Event | None, obs: Observed) -> list[Violation]:
        """Check what one event produced; returns the new violations."""
        self.event_index += 1
        before = len(self.violations)
        self._retired_now: set[str] = set()  # retired at this event (the report redraws them)
        if self._ending:  # requests that ended in earlier events (still shown after theirs)
            self._retire()
        self._scheduling = isinstance(event, Schedule)
        self._touched = set()
        self._let_go: set[str] = set()  # requests that dropped a reference in this event
        if isinstance(event, AddRequest):
            self.prompt_len[event.id] = event.prompt_len
            if event.variant:
                self.variant[event.id] = event.variant
        elif isinstance(event, FailLoad):
            self.failing.add(event.id)
            k = self.fail_from.get(event.id, event.first_bad_block)
            self.fail_from[event.id] = min(k, event.first_bad_block)
        for item in obs.items:
            if isinstance(item, FreeObs):
                self._free(item)
            elif isinstance(item, AllocObs):
                self._alloc(item)
            elif isinstance(item, MoveObs):
                self._move(item)
            elif isinstance(item, CopyObs):
                self._copy(item)
            elif isinstance(item, StepObs):
                self._step(item)
            elif isinstance(item, ProcessObs):
                self._process(item)
            elif isinstance(item, FinishObs):
                self.reqs[item.rid].ended = True
                self._ending.add(item.rid)
                self._ok.pop(item.rid, None)
                self.mark_dead(item.rid)
        if self._deferring:
            # in the requests' order (the order their violations are reported in)
            for rid in sorted(self._deferring, key=lambda r: self.reqs[r].order):
                req = self.reqs[rid]
                if not req.deferred:
                    self._deferring.discard(rid)
                elif req.ended:
                    # let go of as the request ends (vLLM's finish path removes
                    # its skipped blocks first, on its own count): no later step
                    # of it reads them, so this is its end
                    if self.cfg.hazard == "unordered":
                        for f in req.deferred:
                            if not self.refs[f.block]:
                                self._check_returned(f)
                    req.deferred.clear()
                    self._deferring.discard(rid)
                elif req.p is not None and not self._live_pending(rid):
                    for f in req.deferred:
                        self._check_window_free(f, req.p)
                    req.deferred.clear()
                    self._deferring.discard(rid)
        if obs.counters is not None:
            self._counters(obs)
        return self.violations[before:]

    def _retire(self) -> None:
        """Forget the requests that ended and that nothing names any more: no
        unprocessed step (dead or not) has a part of theirs, they hold no slot
        and owe no deferred free. What blocks hold stays (``content``, keyed by
        block): a prefix hit of a later request reads it."""
        named = self._parts
        for rid in list(self._ending):
            req = self.reqs.get(rid)
            if rid in named or self._nheld[rid] or (req is not None and req.deferred):
                continue
            self._ending.discard(rid)
            self._retired_now.add(rid)
            self.reqs.pop(rid, None)
            self._moved.pop(rid, None)
            self._nheld.pop(rid, None)
            self.prompt_len.pop(rid, None)
            self.variant.pop(rid, None)
            self._ok.pop(rid, None)
            self.failing.discard(rid)
            self.fail_from.pop(rid, None)
            self._deferring.discard(rid)

    def in_flight_steps(self) -> int:
        """Steps in flight, the empty ones (nothing scheduled) included."""
        return len(self.pending)

    def busy_steps(self) -> int:
        """Steps in flight that schedule anything."""
        return sum(1 for step in self.pending if step)

    def live_requests(self) -> int:
        """How many requests the counters so far name and none has listed finished."""
        return len(self._last)

    def oldest_step(self) -> list[_Pending]:
        return self.pending[0] if self.pending else []

    # ------------------------------------------------------------ helpers

    def _v(self, prop: int, msg: str, **kw) -> None:
        self.violations.append(Violation(prop, msg, event_index=self.event_index, **kw))

    def _live_pending(self, rid: str) -> list[_Pending]:
        return [pp for pp in self._parts.get(rid, ()) if not pp.dead]

    def _may_read(self, rid: str) -> list[tuple[_Pending, int, int]]:
        """Each unprocessed step of ``rid`` (dead ones too: their kernels still
        run) with the lowest and highest position it may compute, rejections of
        earlier steps' drafts taken at their worst."""
        out = []
        rollback = 0
        for pp in self._parts.get(rid, ()):
            out.append((pp, max(0, pp.reads_from - (0 if pp.dead else rollback)), pp.end))
            if not pp.dead:
                rollback += pp.rs.spec
        return out

    def _readers(self, rid: str, group: int, logical: int, block: int):
        """Unprocessed steps of ``rid`` whose possible positions read ``logical``."""
        g = self.cfg.groups[group]
        P = self.prompt_len.get(rid)
        for pp, lo, hi in self._may_read(rid):
            table = pp.rs.tables[group] if group < len(pp.rs.tables) else ()
            if g.spec.holds_state and self._slots:
                # the worker's table may name the block at another slot too
                # (a relocated speculative block): any slot the part touches
                rb = pp.reads_from - lo
                prb = 0 if pp.prev is None or pp.prev.acc is not None else \
                    max(0, rb - (0 if pp.prev.dead else pp.prev.rs.spec))
                slots = self._state_blocks(pp, g, self.Bs[group], rb, prb)
                if any(x < len(table) and table[x] == block for x in slots):
                    return pp, pp.start
                continue
            if logical < len(table) and table[logical] == block:
                B = self.Bs[group]
                blocks = read_blocks(g, lo, hi, B, P)
                if logical in blocks:
                    t = self._first_reader(g, B, logical, lo, hi, P)
                    if t is not None:
                        return pp, t
        return None

    @staticmethod
    def _first_reader(g: Group, B: int, logical: int, lo: int, hi: int,
                      P: int | None) -> int | None:
        """The first position in ``[lo, hi)`` whose window reaches ``logical``
        (blocks of ``B`` tokens)."""
        x0, x1 = logical * B, (logical + 1) * B
        # attention is causal (position t reads nothing past t), so no position
        # before x0 reaches the block: the scan starts there, not at lo
        for t in range(max(lo, x0), hi):
            if any(x < x1 and y > x0 for x, y in reads(g, t, P)):
                return t
        return None

    @staticmethod
    def _fmt_retained(g: Group, p: int) -> str:
        R = g.spec.reprefill()
        if not R:
            return ""
        return (f", and the next prefill chunk computes [{max(0, p - R)}, {p}) again, reading "
                f"from {g.spec.lo(max(0, p - R))}")

    @staticmethod
    def _fmt_reads(g: Group, t: int, P: int | None) -> str:
        return " and ".join(f"[{x}, {y - 1}]" for x, y in reads(g, t, P))

    # ------------------------------------------------------------ Mamba states

    @staticmethod
    def _state_slot(pp: _Pending, B: int) -> int | None:
        """The slot of a Mamba group's (worker's) table through which ``pp``
        reads the state it starts from, as vLLM's model runner of a hybrid
        model picks it (``preprocess_mamba``, V2's
        ``preprocess_mamba_align_fused_kernel``; :func:`model.mamba_slots.start_slot`)."""
        q = pp.prev
        if q is None:
            return start_slot(pp.start, B)
        return start_slot(pp.start, B, q.end, q.rs.spec)

    def _state_blocks(self, pp: _Pending, g: Group, B: int, rollback: int = 0,
                      prev_rollback: int = 0) -> list[int]:
        """The slots of a Mamba group a step part reads or writes through its
        table: the state it starts from (:meth:`_state_slot`) and the ``1 + K``
        it writes from ``(end - 1) // B`` on; with ``rollback`` (its start may
        still move down that far) and ``prev_rollback`` (the step before it
        likewise), every slot one of those outcomes would touch."""
        K = g.spec.spec_blocks
        out: set[int] = set()
        for e in range(pp.end - rollback, pp.end + 1):
            if e > 0:
                out.update(range(running_slot(e, B), running_slot(e, B) + 1 + K))
        q = pp.prev
        if q is None or not (rollback or prev_rollback):
            r = self._state_slot(pp, B)
            if r is not None:
                out.add(r)
            return sorted(out)
        for qe in range(q.end - prev_rollback, q.end + 1):
            s = running_slot(qe, B)
            out.update(range(s, s + 1 + q.rs.spec))
        return sorted(out)

    def _reads(self, pp: _Pending, gi: int, g: Group, lo: int, hi: int,
               P: int | None) -> Sequence[int]:
        """Logical blocks of group ``gi`` the part reads computing ``[lo, hi)``."""
        if g.spec.holds_state and self._slots and lo == pp.reads_from and hi == pp.end:
            return self._state_blocks(pp, g, self.Bs[gi])
        return read_blocks(g, lo, hi, self.Bs[gi], P)

    def _holds(self, rid: str, gi: int, lg: int, blk: int) -> bool:
        """Whether ``rid`` holds ``blk`` where its step reads it at slot ``lg``:
        there, or (a Mamba group, whose steps read the worker's table, which
        keeps a relocated speculative block at its old slot too) ``blk`` moved
        away from ``lg`` (:class:`MoveObs`) and ``rid`` still holds it."""
        held = self.holder.get((rid, gi, lg))
        if held == blk:
            return True
        if self._moved.get(rid, {}).get((gi, lg)) != blk:
            return False
        return any(k[1] == gi and self.holder[k] == blk for k in self.holder.of(rid))

    def _check_state(self, pp: _Pending) -> None:
        """The state ``pp`` starts from, once the step before it is processed:
        the block at its :meth:`_state_slot` must hold the state after
        position ``start - 1`` of the request. What that step left in its
        blocks follows vLLM's worker: its forward writes its running state
        and one state per draft into its ``1 + spec`` slots from ``s`` on, in
        that order (one block named at two of those slots keeps the later
        state), then its postprocess copies the accepted state into the slot
        of the block edge it reached (``postprocess_mamba_fused_kernel``)."""
        q = pp.prev
        if q is None or q.acc is None or pp.dead:
            return
        a = pp.start
        base = q.end - q.rs.spec
        if a != base + q.acc:
            return  # not the state q left (a failed load's recompute)
        rid = pp.rs.rid
        for gi, g in enumerate(self.cfg.groups):
            if not g.spec.holds_state:
                continue
            B = self.Bs[gi]
            tq = q.rs.tables[gi] if gi < len(q.rs.tables) else ()
            tp = pp.rs.tables[gi] if gi < len(pp.rs.tables) else ()
            held: dict[int, tuple[int, int]] = {}  # block -> (position its state follows, slot)
            for slot, t in written(q.end, q.rs.spec, B):
                if slot < len(tq) and tq[slot] != NULL:
                    held[tq[slot]] = (t, slot)
            copied = None
            cp = checkpoint_copy(q.end, q.rs.spec, a, B)
            if cp is not None:
                src, dest = cp
                if src < len(tq) and dest < len(tq) and tq[dest] != NULL:
                    got = held.get(tq[src])
                    if got is not None:
                        held[tq[dest]] = (got[0], dest)
                        copied = dest
            r = self._state_slot(pp, B)
            if r is None or r >= len(tp) or tp[r] == NULL:
                continue  # the NULL / held check's
            got = held.get(tp[r])
            if got is None or got[0] == a - 1:
                continue
            how = (f"step {q.step}'s postprocess copied the state after {got[0]} there"
                   if got[1] == copied else
                   f"step {q.step} wrote its state after position {got[0]} into it through "
                   f"slot {got[1]} too")
            self._v(2, f"step {pp.step} computes {rid} positions [{a}, {pp.end}) from the "
                       f"Mamba state after position {a - 1}, which step {q.step} left at slot "
                       f"{r} (block {tp[r]}, {g.label()}), but {how}: the block names two "
                       f"slots of the worker's table",
                    step=pp.step, rid=rid, block=tp[r],
                    facts={"fact": "state_slot_shared", "rid": rid, "group": gi,
                           "step": pp.step, "slots": (r, got[1]), "after": a - 1,
                           "by": q.step, "held": got[0], "copied": got[1] == copied})
            return

    # ------------------------------------------------------------ items

    def _alloc(self, a: AllocObs) -> None:
        if a.block == NULL:
            self._v(3, f"request {a.rid} was handed the NULL block at logical {a.logical}",
                    rid=a.rid, block=a.block)
            return
        n = self.refs[a.block]
        if n > 0 and not a.cached:
            self._v(3, f"block {a.block} handed to {a.rid} (logical {a.logical}) while "
                       f"still held ({n} reference(s))", rid=a.rid, block=a.block)
        key = (a.rid, a.group, a.logical)
        if key in self.holder and self.holder[key] != NULL:
            self._v(3, f"{a.rid} logical {a.logical} (group {a.group}) got block {a.block} "
                       f"while holding block {self.holder[key]} there", rid=a.rid, block=a.block)
        prev = self.last_owner.get(a.block)
        if prev is not None and prev != a.rid:
            self.witness["prefix_hit" if a.cached else "block_reused"] += 1
            if a.cached and self._fine[a.group]:
                self.witness["fine_grained_hit"] += 1
        self.last_owner[a.block] = a.rid
        if not a.cached and self.cfg.prefix_caching and a.block in self.content:
            self.witness["cache_evicted"] += 1
        if not a.cached:
            if self.bad:
                self.bad.pop(a.block, None)
            self.content.pop(a.block, None)
            self._ver[a.block] = self._ver.get(a.block, 0) + 1
        if key not in self.holder:
            self._nheld[a.rid] += 1
        self.holder[key] = a.block
        self.refs[a.block] = n + 1
        if n == 0:
            self._owned += 1

    def _move(self, m: MoveObs) -> None:
        """A block moved between two slots of its request (Mamba's speculative
        blocks, relocated past the new running state): it stays held, its old
        slot reads NULL from now on (a step that still reads it there is
        property 2's), its new slot must have been empty."""
        old, new = (m.rid, m.group, m.logical), (m.rid, m.group, m.to)
        if self.holder.get(old) != m.block:
            self._v(3, f"{m.rid} moved block {m.block} from logical {m.logical} (group "
                       f"{m.group}), which it does not hold there", rid=m.rid, block=m.block)
            return
        if self.holder.get(new, NULL) != NULL:
            self._v(3, f"{m.rid} moved block {m.block} to logical {m.to} (group {m.group}), "
                       f"where it holds block {self.holder[new]}", rid=m.rid, block=m.block)
            return
        del self.holder[old]
        self.holder[new] = m.block
        # the worker's table keeps naming it at its old slot (append-only)
        self._moved.setdefault(m.rid, {})[(m.group, m.logical)] = m.block
        self.witness["state_block_moved"] += 1

    def _copy(self, c: CopyObs) -> None:
        """A copy-on-write: ``dst``, a fresh block, holds what ``src`` holds
        when the copy runs (before the next step's forward, after every step
        scheduled earlier wrote), and the request's slot moves to ``dst``
        (``logical >= 0``: a prefix hit ending inside the block), or the
        request keeps ``src`` (``-1``). The copy holds both blocks until the
        step that runs it is processed; under an unordered writer neither may
        return to the pool before (property 1, as request-level frees)."""
        src, dst, key = c.src, c.dst, (c.rid, c.group, c.logical)
        if src == NULL or dst == NULL or self.refs[src] <= 0:
            self._v(3, f"{c.rid} copies block {src} into block {dst} (group {c.group}), but "
                       f"no one holds block {src}", rid=c.rid, block=src)
            return
        if self.refs[dst] > 0:
            self._v(3, f"{c.rid} copies block {src} into block {dst} (group {c.group}) while "
                       f"block {dst} is held ({self.refs[dst]} reference(s))",
                    rid=c.rid, block=dst)
            return
        if c.logical >= 0:
            if self.holder.get(key) != src:
                self._v(3, f"{c.rid} redirects logical {c.logical} (group {c.group}) from block "
                           f"{src}, which it does not hold there", rid=c.rid, block=src)
                return
            self.holder[key] = dst  # its reference of src is the copy's now
            self.refs[dst] += 1
            self.witness["partial_hit"] += 1
        else:
            self.refs[src] += 1
            self.witness["partial_tail_copied"] += 1
        self.refs[dst] += 1
        self._owned += 1
        self.copy_held[(c.rid, c.group, src)] += 1
        self.copy_held[(c.rid, c.group, dst)] += 1
        self._nheld[c.rid] += 2
        self.last_owner[dst] = c.rid
        # a fresh block holds nothing until the copy runs (StepObs.copies)
        self.content.pop(dst, None)
        self.bad.pop(dst, None)
        self._ver[dst] = self._ver.get(dst, 0) + 1
        self._copies.append([c, None])
        self._copy_group[(src, dst)] = c.group

    def _filled_by(self, s: StepObs) -> dict[int, str]:
        """The blocks step ``s`` writes after its copies ran (the model runner
        copies before ``start_load_kv`` and the forward): ``"load"`` where a
        connector's load writes it, ``"forward"`` where only the forward does."""
        out: dict[int, str] = {}
        for rs in s.reqs:
            for a, e, how in ((rs.start - rs.loaded, rs.start, "load"),
                              (rs.start, rs.end, "forward")):
                if e <= a:
                    continue
                for gi in self._kv_groups:
                    B, table = self.Bs[gi], rs.tables[gi] if gi < len(rs.tables) else ()
                    for b in table[a // B:-(-e // B)]:
                        if b != NULL and out.get(b) != "load":
                            out[b] = how
        return out

    def _run_copies(self, copies: tuple[tuple[int, int], ...],
                    later: dict[int, str] | None = None) -> None:
        """The worker's copies before a step's forward, as one gather and one
        scatter (``blocks[dst] = blocks[src]``): every destination gets what
        its source held before any of them was written. ``later``: the
        blocks the step writes after the copies (:meth:`_filled_by`)."""
        content, bad = self.content, self.bad
        got = [(src, dst, content.get(src), bad.get(src), self._copy_group.pop((src, dst), None))
               for src, dst in copies]
        filled = {dst for _src, dst in copies}
        for src, dst, c, b, gi in got:
            self._unfilled.pop(dst, None)
            if c is None:
                if gi not in self._kv_groups:
                    content.pop(dst, None)
                else:
                    self._unfilled[dst] = (src, src in filled, (later or {}).get(src))
                    why = (f"no KV: it is a copy of block {src}, which held nothing when the "
                           f"copies before this step ran (a block handed out afresh, or one "
                           f"another copy of the same step was to fill)")
                    content[dst] = [why] * self.Bs[gi]
            else:
                content[dst] = list(c)
            if b is None:
                bad.pop(dst, None)
            else:
                bad[dst] = b
            self._ver[dst] = self._ver.get(dst, 0) + 1

    def _check_early_copy_frees(self, now: int) -> None:
        """A block a copy reads or writes went back to the pool before the step
        running the copy was processed: harmless until another step is
        scheduled meanwhile (a connector may then load into it, on its own
        stream, while the copy may not have run); ``now`` is being scheduled."""
        keep = []
        for blk, rec in self._early_copy_frees:
            c, step = rec
            if step == now:  # its own step, being scheduled
                keep.append((blk, rec))
                continue
            if step not in self.pending_ids:
                continue  # processed: the copy ran
            self._v(1, f"block {blk} returned to the pool (copy of block {c.src} into block "
                       f"{c.dst} for {c.rid}, group {c.group}) while step {step}, which runs "
                       f"the copy, is unprocessed, and step {now} is scheduled meanwhile "
                       f"(unordered writer present: a load into it races the copy)",
                    step=step, rid=c.rid, block=blk)
        self._early_copy_frees = keep

    def _free_copy(self, f: FreeObs) -> None:
        key = (f.rid, f.group, f.block)
        if not self.copy_held.get(key):
            self._v(3, f"{f.rid} returned block {f.block} (group {f.group}) held for a copy "
                       f"it does not have (double free?)", rid=f.rid, block=f.block)
            return
        self.copy_held[key] -= 1
        if not self.copy_held[key]:
            del self.copy_held[key]
        self._nheld[f.rid] -= 1
        n = self.refs[f.block] - 1
        self.refs[f.block] = n
        if n == 0:
            self._owned -= 1
        # the latest copy of rid's that names the block
        rec = next((r for r in reversed(self._copies) if r[0].rid == f.rid
                    and r[0].group == f.group and f.block in (r[0].src, r[0].dst)), None)
        if rec is not None:
            c, step = rec
            running = step is None or step in self.pending_ids
            if running and n == 0 and self.cfg.hazard == "unordered":
                # in the pool before the copy ran: a connector loading into it
                # for a step scheduled before that one is processed races the copy
                self._early_copy_frees.append((f.block, rec))
        if n == 0 and self.cfg.hazard == "unordered":
            self._check_returned(f)

    def _free(self, f: FreeObs) -> None:
        self._let_go.add(f.rid)
        if f.reason == "copy":
            self._free_copy(f)
            return
        key = (f.rid, f.group, f.logical)
        dkey = (*key, f.block)
        if self.detached.get(dkey):
            # the old incarnation's deferred free, even if the re-admitted
            # request took the same block again (a prefix-cache hit)
            self.detached[dkey] -= 1
            if not self.detached[dkey]:
                del self.detached[dkey]
            self._nheld[f.rid] -= 1
        elif self.holder.get(key) == f.block:
            del self.holder[key]
            self._nheld[f.rid] -= 1
        else:
            self._v(3, f"{f.rid} returned block {f.block} (logical {f.logical}, group "
                       f"{f.group}, {f.reason}) that it does not hold (double free?)",
                    rid=f.rid, block=f.block)
            return
        n = self.refs[f.block] - 1
        self.refs[f.block] = n
        if n == 0:
            self._owned -= 1
        if n < 0:
            self._v(3, f"block {f.block} refcount below zero", block=f.block)
        req = self.reqs[f.rid]
        if f.reason == "window":
            req.window_freed += 1
            self.witness["window_free"] += 1
            # the first position still read: by the oldest step in flight, else the next
            live = self._live_pending(f.rid)
            first = skipped(self.cfg.groups[f.group], min((pp.start for pp in live), default=req.p))
            if 0 <= first - (f.logical + 1) * self.Bs[f.group] <= 1:
                self.witness["window_free_at_edge"] += 1
            if self._live_pending(f.rid):
                self.witness["free_while_in_flight"] += 1
                self._check_window_free(f, req.p)
            else:
                # freed while (re)entering a step: judged once the step shows
                # where the request starts (prefix hit, load, recompute)
                req.deferred.append(f)
                self._deferring.add(f.rid)
        else:
            if n == 0 and self.cfg.hazard == "unordered":
                self._check_returned(f)

    def _check_window_free(self, f: FreeObs, p: int) -> None:
        g = self.cfg.groups[f.group]
        B = self.Bs[f.group]
        P = self.prompt_len.get(f.rid)
        hit = self._readers(f.rid, f.group, f.logical, f.block)
        if not g.spec.reads_positions:  # a ring, the encoder's outputs: never freeable
            during = f" while step {hit[0].step} reads it" if hit is not None else ""
            self._v(1, f"block {f.block} (logical {f.logical} of {f.rid}, {g.label()}: read by "
                       f"every step of the request) returned out-of-window{during} at settled "
                       f"count {p}; nothing of {g.kind} is freeable before the request ends",
                    step=hit[0].step if hit is not None else None, rid=f.rid, block=f.block)
        elif hit is not None and self._stream_ordered:
            # one ordered forward stream: only a later step writes the block,
            # after this one read it; a rollback (drafts) could still need it
            self.witness["free_read_in_flight"] += 1
            low = self._rollback_floor(f.rid, p)
            if self.cfg.spec_tokens and f.logical not in freeable_blocks(g, low, B, P):
                self._v(1, f"block {f.block} (logical {f.logical} of {f.rid}, positions "
                           f"[{f.logical * B}, {(f.logical + 1) * B})) returned "
                           f"out-of-window though a rollback to count {low} (settled {p}, "
                           f"every draft in flight rejected) needs "
                           f"{self._fmt_reads(g, low, P)}{self._fmt_retained(g, low)} "
                           f"({g.label()})", rid=f.rid, block=f.block)
        elif hit is not None:
            pp, t = hit
            if self.cfg.stream_ordered:
                self.witness["free_read_in_flight"] += 1
            self._v(1, f"block {f.block} (logical {f.logical} of {f.rid}, positions "
                       f"[{f.logical * B}, {(f.logical + 1) * B})) returned "
                       f"out-of-window "
                       f"while step {pp.step} is unprocessed and position {t} of it reads "
                       f"{self._fmt_reads(g, t, P)} (settled count {p}, {g.label()})",
                    step=pp.step, rid=f.rid, block=f.block,
                    facts={"fact": "freed_while_read", "rid": f.rid, "group": f.group,
                           "logical": f.logical, "step": pp.step, "position": t,
                           "block_size": B})
        elif self._stream_ordered:
            # nothing in flight reads it: only a later step could, after a rollback
            low = self._rollback_floor(f.rid, p)
            if self.cfg.spec_tokens and f.logical not in freeable_blocks(g, low, B, P):
                self._v(1, f"block {f.block} (logical {f.logical} of {f.rid}, positions "
                           f"[{f.logical * B}, {(f.logical + 1) * B})) returned "
                           f"out-of-window though a rollback to count {low} (settled {p}, "
                           f"every draft in flight rejected) needs "
                           f"{self._fmt_reads(g, low, P)}{self._fmt_retained(g, low)} "
                           f"({g.label()})", rid=f.rid, block=f.block)
        elif f.logical not in freeable_blocks(g, p, B, P):
            self._v(1, f"block {f.block} (logical {f.logical} of {f.rid}, positions "
                       f"[{f.logical * B}, {(f.logical + 1) * B})) returned "
                       f"out-of-window "
                       f"though a rollback to the settled count {p} needs "
                       f"{self._fmt_reads(g, p, P)}{self._fmt_retained(g, p)} ({g.label()})",
                    rid=f.rid, block=f.block,
                    facts={"fact": "freed_before_settled", "rid": f.rid, "group": f.group,
                           "logical": f.logical, "settled": p, "block_size": B})

    def _rollback_floor(self, rid: str, p: int) -> int:
        """The lowest count ``rid`` can be rolled back to: its settled count
        plus the tokens of its steps in flight that are not drafts (only a
        rejected draft lowers the count). Under one ordered forward stream a
        step in flight reads before any later step writes, so a window free
        is judged only against the steps scheduled after it, which start at
        this count at the lowest."""
        return p + sum(pp.end - pp.start - pp.rs.spec for pp in self._live_pending(rid))

    def _check_returned(self, f: FreeObs) -> None:
        """A block went back to the pool (request-level): no unprocessed step
        of any request may still read it, since an unordered writer may fill it."""
        for step in self.pending:
            for pp in step:
                for gi, table in enumerate(pp.rs.tables):
                    if gi != f.group:
                        continue
                    g = self.cfg.groups[gi]
                    P = self.prompt_len.get(pp.rs.rid)
                    for lg in self._reads(pp, gi, g, pp.reads_from, pp.end, P):
                        if lg < len(table) and table[lg] == f.block:
                            self._v(1, f"block {f.block} returned to the pool ({f.reason} of "
                                       f"{f.rid}) while step {pp.step} of {pp.rs.rid} still reads "
                                       f"it at logical {lg} (positions [{pp.start}, {pp.end}), "
                                       f"unordered writer present)",
                                    step=pp.step, rid=f.rid, block=f.block)
                            return

    def _step(self, s: StepObs) -> None:
        if self._copies:
            held = self.copy_held
            for rec in self._copies:  # the copies queued since the last step run with this one
                if rec[1] is None:
                    rec[1] = s.step
            # forget the copies whose blocks are all returned (their step is known now)
            self._copies = [r for r in self._copies
                            if held.get((r[0].rid, r[0].group, r[0].src))
                            or held.get((r[0].rid, r[0].group, r[0].dst))]
        if self._early_copy_frees:
            self._check_early_copy_frees(s.step)
        if s.copies:
            self._run_copies(s.copies, self._filled_by(s))
        if self.bad:
            self._check_bad(s)
        for rs in s.reqs:  # every write of the step lands before any read (per layer)
            if rs.loaded:
                self._write(rs.rid, rs.tables, rs.start - rs.loaded, rs.start, s.step)
            self._write(rs.rid, rs.tables, rs.start, rs.end, s.step)
        row = []
        # nothing below changes self.pending, self._parts or a part's dead flag
        for rs in s.reqs:
            req = self.reqs[rs.rid]
            self._touched.add(rs.rid)
            if not self._live_pending(rs.rid):
                req.p = rs.start - rs.loaded
                for f in req.deferred:
                    self._check_window_free(f, req.p)
                req.deferred.clear()
            if rs.loaded:
                req.loaded = (rs.start - rs.loaded, rs.start)
            pp = _Pending(s.step, rs)
            # a step continuing the request's prefill where its last chunk
            # ended: a lagging drafter computes that chunk's last positions again
            P = self.prompt_len.get(rs.rid)
            if self._reprefill and req.chunk is not None and req.chunk[1] == rs.start \
                    and P is not None and 0 < rs.start < P:
                pp.lead = min(self._reprefill, rs.start - req.chunk[0])
                if any(g.spec.reprefill() and g.spec.lo(pp.reads_from) // self.Bs[gi]
                       < g.spec.lo(rs.start) // self.Bs[gi]
                       for gi, g in enumerate(self.cfg.groups)):
                    self.witness["reprefill_reach"] += 1
            req.chunk = (rs.start, rs.end)
            if self._mamba:
                pp.prev, req.last_part = req.last_part, pp
            self._check_reads(pp, "scheduled")
            if self._slots:
                self._check_state(pp)
            P = self.prompt_len.get(rs.rid)
            if (self._held_groups and rs.start >= self.B
                    and self._live_pending(rs.rid)):
                self.witness["kept_in_flight"] += 1
            for gi, g in enumerate(self.cfg.groups):
                n = len(freeable_blocks(g, rs.end, self.Bs[gi], P))
                if n > req.last_freeable.get(gi, 0):
                    self.witness["window_edge_crossing"] += 1
                req.last_freeable[gi] = n
            row.append(pp)
        self.pending.append(row)
        self.pending_ids.append(s.step)
        parts = self._parts
        for pp in row:
            lst = parts.get(pp.rs.rid)
            if lst is None:
                parts[pp.rs.rid] = [pp]
            else:
                lst.append(pp)

    def _check_bad(self, s: StepObs) -> None:
        """A step reads the positions below each request's start from the cache
        (per layer, after every request of the step wrote its own positions):
        none of them may lie in a block's bad range. Writes make good what they
        cover, from the bad range's start on."""
        bad = self.bad
        for rs in s.reqs:  # the step's writes first
            a, b = rs.start, rs.end
            for table, B in zip(rs.tables, self.Bs, strict=False):
                for lg in range(a // B, min(-(-b // B), len(table))):
                    r = bad.get(table[lg])
                    if r is not None and a <= r[0]:
                        if b >= r[1]:
                            del bad[table[lg]]
                        else:
                            bad[table[lg]] = (max(r[0], b), r[1])
        for rs in s.reqs:
            hit = self._bad_read(rs, bad)
            if hit is not None:
                g, lg, blk, x, y = hit
                a = rs.start
                rd = self._fmt_reads(g, a, self.prompt_len.get(rs.rid))
                self._v(2, f"step {s.step} (scheduled) computes {rs.rid} positions "
                           f"[{a}, {rs.end}); position {a} reads {rd} "
                           f"({g.label()}) but block {blk} (logical {lg}) holds no "
                           f"valid KV for positions [{x}, {y}): a connector load into it "
                           f"failed and nothing computed them again",
                        step=s.step, rid=rs.rid, block=blk,
                        facts={"fact": "reads_failed_load", "rid": rs.rid, "step": s.step,
                               "start": a, "end": rs.end, "bad_from": x, "bad_to": y,
                               "logical": lg})
                del bad[blk]
                return

    def _check_reads(self, pp: _Pending, when: str) -> None:
        rs = pp.rs
        rid, tables = rs.rid, rs.tables
        start, end = pp.reads_from, pp.end
        held = self.holder.get
        P = self.prompt_len.get(rid)
        for gi, g in enumerate(self.cfg.groups):
            B = self.Bs[gi]
            table = tables[gi] if gi < len(tables) else ()
            n = len(table)
            for lg in self._reads(pp, gi, g, start, end, P):
                blk = table[lg] if lg < n else None
                if blk is None or blk == NULL or (held((rid, gi, lg)) != blk
                                                  and not self._holds(rid, gi, lg, blk)):
                    t = self._first_reader(g, B, lg, start, end, P)
                    t = start if t is None else t
                    what = ("no block" if blk is None else "the NULL block" if blk == NULL
                            else f"block {blk}, which {rs.rid} does not hold")
                    self._v(2, f"step {pp.step} ({when}) computes {rs.rid} positions "
                               f"[{pp.start}, {pp.end}); position {t} reads "
                               f"{self._fmt_reads(g, t, P)} ({g.label()}) but logical block "
                               f"{lg} maps to {what}",
                            step=pp.step, rid=rs.rid, block=blk,
                            facts={"fact": "reads_null" if blk == NULL else
                                   "reads_no_block" if blk is None else "reads_foreign",
                                   "rid": rs.rid, "group": gi, "logical": lg,
                                   "step": pp.step, "when": when, "start": pp.start,
                                   "end": pp.end, "position": t, "block_size": B})
                    return
            if g.spec.holds_state and self._slots and self._state_clash(pp, gi, g, table, when):
                return
        self._check_content(pp, when)

    def _state_clash(self, pp: _Pending, gi: int, g: Group, table: tuple[int, ...],
                     when: str) -> bool:
        """A Mamba step writes its running state and one state per draft into
        the ``1 + spec`` slots from ``s = (end - 1) // B`` of its table; the
        next step starts from the one its acceptance picks, so each must land
        in a block of its own (one block at two of those slots keeps only the
        later state)."""
        B = self.Bs[gi]
        s = running_slot(pp.end, B)
        base = pp.end - pp.rs.spec
        seen: dict[int, int] = {}
        for slot, _t in written(pp.end, pp.rs.spec, B):
            if slot >= len(table) or table[slot] == NULL:
                continue
            j = slot - s
            blk = table[slot]
            if blk in seen:
                i = seen[blk]
                self._v(2, f"step {pp.step} ({when}) computes {pp.rs.rid} positions "
                           f"[{pp.start}, {pp.end}) and writes the Mamba states after "
                           f"positions {base - 1 + i} and {base - 1 + j} ({g.label()}) into "
                           f"one block, {blk}, named at slots {s + i} and {s + j} of the "
                           f"worker's table: the next step starts from the first if "
                           f"{i} draft(s) are accepted, and it holds the second",
                        step=pp.step, rid=pp.rs.rid, block=blk,
                        facts={"fact": "state_clash", "rid": pp.rs.rid, "group": gi,
                               "step": pp.step, "slots": (s + i, s + j),
                               "positions": (base - 1 + i, base - 1 + j), "accepted": i})
                return True
            seen[blk] = j
        return False

    # ------------------------------------------------------------ KV content

    def _write(self, rid: str, tables: tuple[tuple[int, ...], ...], a: int, e: int,
               step: int, why: str | None = None) -> None:
        """Positions ``[a, e)`` of ``rid`` written through ``tables`` by ``step``
        (its computed positions, or a connector's load before it runs); with
        ``why``, what they hold instead of valid KV."""
        P = self.prompt_len.get(rid)
        if P is None or e <= a:
            return
        content = self.content
        V = self.variant.get(rid, 0)
        ver = self._ver
        for gi in self._kv_groups:
            B = self.Bs[gi]
            table = tables[gi] if gi < len(tables) else ()
            plain = why is None and not V and gi != self._lookahead_group
            for lg in range(a // B, min(-(-e // B), len(table))):
                blk = table[lg]
                if blk == NULL:
                    continue
                c = content.get(blk)
                if c is None:
                    c = content[blk] = [None] * B
                ver[blk] = ver.get(blk, 0) + 1
                base = lg * B
                lo, hi = max(a, base), min(e, base + B)
                if plain:  # prefix_key of variant 0, inline (the common case)
                    c[lo - base:hi - base] = [(q if q < P else (P, q), step, rid)
                                              for q in range(lo, hi)]
                    continue
                for q in range(lo, hi):
                    c[q - base] = why or (self._key(gi, P, q, V), step, rid)

    def _check_content(self, pp: _Pending, when: str) -> None:
        """Every position a step part reads from the cache (its window below
        its start) must hold KV some step or load wrote, before this step or in
        it, for this request's own token prefix: not nothing (a slot no one
        wrote since the block was handed out), not another prefix's KV (a stale
        block), not a rejected draft's. A sink group's reserved blocks must
        hold the sink's KV, which every step reads. A block range already found
        good for the request at the block's current version is not read again
        (a block's version moves with every write), so a step costs its window's
        blocks, not its positions."""
        rs = pp.rs
        rid = rs.rid
        P = self.prompt_len.get(rid)
        a = pp.start
        if P is None:
            return
        content, ver = self.content, self._ver
        V = self.variant.get(rid, 0)
        for gi in self._kv_groups:
            g = self.cfg.groups[gi]
            B = self.Bs[gi]
            table = rs.tables[gi] if gi < len(rs.tables) else ()
            plain = not V and gi != self._lookahead_group
            for blk, lg, x, y in self._cache_ranges(g, B, table, a, P, pp.lead):
                ok = self._ok.setdefault(rid if lg is not None else "", {})
                v = ver.get(blk, 0)
                seen = ok.get((blk, lg))
                if seen is not None and seen[0] == v and seen[1] <= x and y <= seen[2]:
                    continue
                c = content.get(blk)
                if plain and lg is not None and c is not None:
                    # prefix_key of variant 0, inline (the common case): only a
                    # slot that differs is looked at again below
                    base = lg * B
                    good = True
                    for o in range(x, y):
                        got = c[o]
                        q = base + o
                        if (got is None or got.__class__ is str
                                or got[0] != (q if q < P else (P, q))):
                            good = False
                            break
                    if good:
                        if seen is not None and seen[0] == v and x <= seen[2] and seen[1] <= y:
                            x, y = min(x, seen[1]), max(y, seen[2])
                        ok[(blk, lg)] = (v, x, y)
                        continue
                for o in range(x, y):
                    want = (("sink", (blk - 1) * B + o) if lg is None
                            else self._key(gi, P, lg * B + o, V))
                    got = c[o] if c is not None else None
                    if got is not None and not isinstance(got, str) and got[0] == want:
                        continue
                    if lg is None:
                        where = (f"every position reads the sink ({g.label()}, physical blocks "
                                 f"{', '.join(map(str, g.spec.reserved_blocks(B)))}) but "
                                 f"block {blk} holds, at sink token {want[1]}, "
                                 f"{self._what(got, 'the', want)}")
                    else:
                        whose = f"{rid}'s"
                        pos = lg * B + o
                        draft = (" (its EAGLE draft KV, built with the next token)"
                                 if key_position(want) != pos else "")
                        where = (f"position {a} reads {self._fmt_reads(g, a, P)} ({g.label()}) "
                                 f"but block {blk} (logical {lg}) holds, at position "
                                 f"{pos}{draft}, {self._what(got, whose, want)}")
                    copied = (self._unfilled.get(blk) if isinstance(got, str)
                              and got.startswith("no KV: it is a copy") else None)
                    facts = None
                    if copied is not None and lg is not None:
                        facts = {"fact": "copy_of_unfilled", "rid": rid, "step": pp.step,
                                 "group": gi, "logical": lg, "src": copied[0], "dst": blk,
                                 "chained": copied[1], "filled_later": copied[2]}
                    elif lg is not None and isinstance(got, tuple) and \
                            key_position(want) != lg * B + o:
                        # a draft layer's KV built with another continuation's token
                        facts = {"fact": "reads_draft_of_other", "rid": rid, "step": pp.step,
                                 "group": gi, "logical": lg, "block": blk,
                                 "position": lg * B + o, "key": key_position(want),
                                 "writer": got[2], "written_by": got[1]}
                    elif lg is None and isinstance(got, tuple):  # a step wrote over the sink
                        facts = {"fact": "sink_overwritten", "rid": got[2], "step": got[1],
                                 "group": gi, "block": blk, "reader": rid,
                                 "read_by": pp.step,
                                 "sink": list(g.spec.reserved_blocks(B))}
                    self._v(2, f"step {pp.step} ({when}) computes {rid} positions "
                               f"[{pp.start}, {pp.end}); {where}",
                            step=pp.step, rid=rid, block=blk, facts=facts)
                    return
                if seen is not None and seen[0] == v and x <= seen[2] and seen[1] <= y:
                    x, y = min(x, seen[1]), max(y, seen[2])
                ok[(blk, lg)] = (v, x, y)

    def _key(self, gi: int, P: int, q: int, V: int):
        """The token prefix the KV of position ``q`` in group ``gi`` depends on."""
        if gi == self._lookahead_group and q < P:
            return prefix_key(P, q + 1, V)
        return prefix_key(P, q, V)

    @staticmethod
    def _cache_ranges(g: Group, B: int, table: tuple[int, ...], a: int, P: int,
                      lead: int = 0):
        """The slots a step starting at ``a`` reads from the cache through
        ``table`` (blocks of ``B`` tokens), per block as ``(block, logical or
        None for the sink, first offset, end offset)``: the sink's reserved
        blocks, then its window below ``a`` (NULL slots left to the NULL
        check); with ``lead``, also the positions ``[a - lead, a)`` it computes
        again and their windows."""
        for blk in g.spec.reserved_blocks(B):
            yield blk, None, 0, B
        ranges = cached_reads(g, a, P)
        if lead and a - lead > 0:
            ranges = ((cached_reads(g, a - lead, P) or ((a - lead, a),))[0][0], a),
        for x0, x1 in ranges:
            for lg in range(x0 // B, min(-(-x1 // B), len(table))):
                blk = table[lg]
                if blk != NULL:
                    base = lg * B
                    yield blk, lg, max(x0, base) - base, min(x1, base + B) - base

    @staticmethod
    def _what(got, whose: str, want) -> str:
        """What a slot holds instead of ``want`` (``whose``: "r1's", "the")."""
        if got is None:
            return "no KV: nothing wrote it since the block was handed out"
        if isinstance(got, str):
            return got
        return (f"KV of {describe_key(got[0])} (written by step {got[1]} for {got[2]}), "
                f"not {whose} {describe_key(want)}")

    def _process(self, po: ProcessObs) -> None:
        if not self.pending:
            self._v(4, f"output of step {po.step} processed but no step is in flight",
                    step=po.step)
            return
        sid = self.pending_ids.pop(0)
        row = self.pending.pop(0)
        parts = self._parts
        for pp in row:  # the oldest parts of their requests
            rid = pp.rs.rid
            self._touched.add(rid)
            lst = parts[rid]
            del lst[next(i for i, q in enumerate(lst) if q is pp)]
            if not lst:
                del parts[rid]
        if sid != po.step:
            self._v(4, f"step {po.step} processed while step {sid} is the oldest in flight",
                    step=po.step)
        accepted = dict(po.accepted)
        failed = dict(po.failed)
        discarded = set(po.discarded)
        fresh: dict[int, tuple[int, int]] = {}
        for pp in row:  # the loads of this step that failed spoil blocks from here on
            rid = pp.rs.rid
            if rid in failed:
                fresh.update(self._invalidate(rid, self.reqs[rid], self.fail_from.pop(rid, None)))
        # a copy run after this step (a later step's, run when it was scheduled)
        # took what a spoiled block held: its destination holds no valid KV either
        # (vLLM's Mamba state at a prompt's last hash boundary keeps its cache
        # entry there)
        grown = bool(fresh)
        while grown:
            grown = False
            for c, at in self._copies:
                if at is not None and at > po.step and c.src in fresh and c.dst not in fresh:
                    fresh[c.dst] = self.bad[c.dst] = fresh[c.src]
                    grown = True
        if fresh:  # steps already run or in flight that read them: their output is garbage
            for part in [*row, *(q for step in self.pending for q in step)]:
                if not part.tainted and (hit := self._bad_read(part.rs, fresh)):
                    _g, lg, blk, x, y = hit
                    part.tainted = (blk, lg, x, y)
        for pp in row:
            rid = pp.rs.rid
            if pp.tainted and rid in accepted and rid not in failed:
                blk, lg, x, y = pp.tainted
                self._v(2, f"the output of step {po.step} for {rid} counts, but the step read "
                           f"block {blk} (logical {lg}, positions [{x}, {y})), which a failed "
                           f"connector load left without KV",
                        step=po.step, rid=rid,
                        facts={"fact": "output_counts_after_failed_read", "rid": rid,
                               "step": po.step, "block": blk, "logical": lg,
                               "bad_from": x, "bad_to": y})
        for pp in row:
            rid = pp.rs.rid
            req = self.reqs[rid]
            if rid in failed:
                req.last_part = None  # it recomputes from what the recovery says
                self.failing.discard(rid)
                self.witness["failed_load"] += 1
                if self._live_pending(rid):
                    self.witness["failed_load_in_flight"] += 1
                req.p = failed[rid] * self.B
                for later in self._live_pending(rid):
                    later.dead = True
                continue
            if pp.dead or rid in discarded:
                continue
            rejected = pp.rs.spec - accepted.get(rid, pp.rs.spec)
            pp.acc = pp.rs.spec - rejected
            req.p = pp.end - rejected
            if rejected > 0:
                self.witness["draft_rejected"] += 1
                if req.window_freed:
                    self.witness["rollback_near_free"] += 1
                if self._mamba and (pp.end - rejected - 1) // self.B < (pp.end - 1) // self.B:
                    self.witness["checkpoint_near_rejection"] += 1
                tables = pp.rs.tables
                self._write(rid, tables, pp.end - rejected, pp.end, po.step,
                            f"the KV of a draft step {po.step} computed and the output rejected")
                for later in self._live_pending(rid):
                    # it computes (and writes) its positions shifted down
                    self._write(rid, later.rs.tables, later.end - rejected, later.end, later.step,
                                f"no KV: step {later.step} was to write it but a rejection "
                                f"shifted it down")
                    later.shift += rejected
                    self._write(rid, later.rs.tables, later.start, later.end, later.step)
                    self._check_reads(later, f"shifted down {later.shift} by rejection")
            if self._slots:
                nxt = next((q for q in self._live_pending(rid) if q.prev is pp), None)
                if nxt is not None:
                    self._check_state(nxt)
        # A failed load hits every request holding the bad blocks (a prefix-cache
        # hit shares them), not only the one that loaded: those recompute too.
        in_row = {pp.rs.rid for pp in row}
        for rid, k in failed.items():
            if rid not in in_row:
                self.failing.discard(rid)
                self.fail_from.pop(rid, None)
                self.witness["failed_load"] += 1
                self.reqs[rid].p = k * self.B
                self._touched.add(rid)
                for later in self._live_pending(rid):
                    later.dead = True
        if self._mamba:
            for pp in row:  # processed: no later check reads what came before it
                pp.prev = None
        # A discarded output says nothing about later steps: a request that
        # resumed at once after a preemption (vLLM 0.25.1) has live steps after
        # the discarded ones; those scheduled before the preemption were marked
        # dead when the request stopped running.

    def _invalidate(self, rid: str, req: _Req, first_bad: int | None) -> dict[int, tuple[int, int]]:
        """A load failed from logical block ``first_bad`` (the event's index, not
        what the target says it recomputes): from there on, what the request's
        blocks hold is not valid KV, the load's positions and everything
        computed after them alike (later layers read the missing KV). Returns
        the blocks it spoiled, with their bad positions."""
        if first_bad is None or req.loaded is None:
            return {}
        lo = max(first_bad * self.B, req.loaded[0])
        out = {}
        for key in self.holder.of(rid):
            _hr, group, lg = key
            blk = self.holder[key]
            B = self.Bs[group]
            if (blk != NULL and (lg + 1) * B > lo
                    and group not in self._held_groups):
                out[blk] = self.bad[blk] = (max(lo, lg * B), (lg + 1) * B)
        return out

    def _bad_read(self, rs: ReqStep, bad: dict[int, tuple[int, int]]
                  ) -> tuple[Group, int, int, int, int] | None:
        """The first spoiled positions ``[x, y)`` a step part reads from the
        cache, as ``(group, logical, block, x, y)``: its window below its start
        (its own positions it writes first; a load lands before the kernel, so
        a part of the loading step that reads the loaded positions counts)."""
        a = rs.start
        P = self.prompt_len.get(rs.rid)
        for g, table, B in zip(self.cfg.groups, rs.tables, self.Bs, strict=False):
            if not g.spec.reads_positions:
                continue
            for x0, x1 in cached_reads(g, a, P):
                for lg in range(x0 // B, min(-(-x1 // B), len(table))):
                    r = bad.get(table[lg])
                    if r is not None and max(r[0], x0) < min(r[1], x1):
                        return g, lg, table[lg], max(r[0], x0), min(r[1], x1)
        return None

    def _detach(self, rid: str, preempted: bool = False) -> None:
        """A request stopped running: its table is let go at once, while its
        blocks may reach the pool later (vLLM defers them behind the steps in
        flight). A later FreeObs is matched here, so a re-admitted request
        may take new blocks at the same slots meanwhile."""
        kept = self.holder.of(rid)
        self._moved.pop(rid, None)  # a resumed request's worker row is replaced
        for key in kept:  # (still counted in _nheld: a detached entry owes its free)
            self.detached[(*key, self.holder.pop(key))] += 1
        if not (preempted and self._scheduling):
            return
        self.witness["preempt_in_schedule"] += 1
        if kept and rid not in self._let_go:
            self._v(7, f"schedule() preempted {rid}, which holds {len(kept)} block(s), but "
                       f"let none of them go in that step (they wait behind its in-flight "
                       f"steps): the preemption frees nothing the scheduler can use", rid=rid)

    def mark_dead(self, rid: str, preempted: bool = False) -> None:
        """A request was preempted / ended: its in-flight outputs no longer count."""
        self.reqs[rid].chunk = None
        self.reqs[rid].last_part = None
        self._touched.add(rid)
        live = self._live_pending(rid)
        if preempted and live:
            self.witness["preempt_in_flight"] += 1
        for pp in live:
            pp.dead = True

    def _counters(self, obs: Observed) -> None:
        c = obs.counters
        owned = self._owned
        for fault in c.pool_faults:  # the target's own pool structures, as it reads them
            self._v(3, f"pool integrity: {fault}")
        if not c.free_blocks and self.reserved:
            self.witness["pool_drained"] += 1
        # a sink's reserved blocks are out of the pool for good (counted neither
        # free nor owned), unless a request holds them
        kept = sum(1 for b in self.reserved if not self.refs[b]) if self.reserved else 0
        if c.free_blocks + owned + 1 != c.total_blocks and (
                not kept or c.free_blocks + owned + 1 + kept != c.total_blocks):
            n = c.total_blocks - (c.free_blocks + owned + 1)
            why = (f"{n} block(s) neither free nor held by any request (a reference kept "
                   f"after the last holder let go?)" if n > 0 else
                   f"{-n} block(s) counted free while a request holds them (a holder took "
                   f"no reference, or a held block was freed?)")
            self._v(3, f"pool accounting: free {c.free_blocks} + owned {owned} + NULL 1 != total "
                       f"{c.total_blocks}: {why}")
        # Fold what this event lists into the last counters of every live
        # request; judge those listed and those whose expected counts this
        # event changed, in the order requests were first named. A request
        # neither listed nor touched reads as it did after the last event it
        # was judged at.
        last, busy, reqs = self._last, self._busy, self.reqs
        judged = set()
        for rid, rc in c.reqs.items():
            if rc.status == "finished":
                last.pop(rid, None)
                busy.discard(rid)
                continue
            last[rid] = rc
            if rc.in_flight:
                busy.add(rid)
            else:
                busy.discard(rid)
            judged.add(rid)
        for rid in self._touched:
            if rid in last:
                judged.add(rid)
        order = sorted(judged, key=lambda r: reqs[r].order) if len(judged) > 1 else judged
        if not self.pending:
            if not last and c.free_blocks not in (c.total_blocks - 1,
                                                  c.total_blocks - 1 - len(self.reserved)):
                n = c.total_blocks - 1 - c.free_blocks
                self._v(3, f"leak: no request is live and nothing is in flight, yet only "
                           f"{c.free_blocks} of {c.total_blocks - 1} blocks are free: {n} "
                           f"block(s) never returned to the pool")
            for rid in sorted(busy, key=lambda r: reqs[r].order):
                self._v(4, f"{rid} reports {last[rid].in_flight} tokens in flight while no "
                           f"step is in flight", rid=rid)
        bound = c.bound or self._bound_default
        nbound = len(bound)
        for rid in order:
            rc = last[rid]
            status = rc.status
            req = reqs[rid]
            if status == "preempted" or status == "waiting":
                if not req.stopped:
                    req.stopped = True
                    self.mark_dead(rid, preempted=True)
                    self._detach(rid, preempted=status == "preempted")
            else:
                req.stopped = False
            for gi, n in enumerate(rc.live):
                if gi < nbound and n > bound[gi]:
                    self._v(5, f"{rid} holds {n} live blocks in group {gi} "
                               f"({self.cfg.groups[gi].label()}), above the bound {bound[gi]}",
                            rid=rid)
            if status == "preempted" or status == "waiting":
                continue
            live = self._live_pending(rid)
            exp_f = 0
            for pp in live:
                exp_f += pp.rs.end - pp.rs.start
            if rc.in_flight is not None and rc.in_flight != exp_f:
                # f must cover every live in-flight token (less would free
                # on a count ahead of the device) and count nothing that is
                # not in flight; steps whose output will be dropped may count
                all_f = sum(pp.rs.end - pp.rs.start for pp in self._parts.get(rid, ()))
                if not exp_f <= rc.in_flight <= all_f:
                    self._v(4, f"{rid} reports {rc.in_flight} tokens in flight; its unprocessed "
                               f"steps hold {exp_f}" + (f" ({all_f} with discarded outputs)"
                                                        if all_f != exp_f else ""), rid=rid)
            if req.p is not None and live:
                loading = live[0].rs.loaded
                exp_c = req.p + exp_f + loading
                if rc.computed != exp_c:
                    self._v(4, f"{rid} num_computed_tokens is {rc.computed}; settled {req.p} + "
                               f"in flight {exp_f} + loading {loading} = {exp_c}", rid=rid)
