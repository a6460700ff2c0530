"""Numerical confirmation: push a target's observations through real paged
attention and compare every computed position with dense attention over the
true K/V. A step that read NULL (NaN-poisoned) or overwritten KV shows it.

What runs when (the device timeline this replay models)::

    events    Schedule s0   Schedule s1   Process(s0)      Process(s1)
    host      s0 tables     frees, s1     s0 output        s1 output
    device                                [s0 kernel]      [s1 kernel]
                            ^ unordered writer fills freed blocks here,
                              before s0's kernel reads them

* A step's kernel runs when its output is processed (``ProcessObs``): at
  depth D that is after up to D-1 later steps were scheduled and their frees
  happened. The kernel first writes the K/V of all its new tokens through the
  tables it was scheduled with (as ``reshape_and_cache`` does for the whole
  batch), then each computed position attends over its group's window
  (:func:`model.windows.window`), gathered through the same table. Steps never
  processed (the trace ends) run at the end, in order.
* Rejections: when a step's output rejects ``r`` drafts of a request, every
  later unprocessed step of that request computes at positions shifted down
  by ``r`` (SEMANTICS.md). The shift is applied when those steps run; the
  rejected positions of the step itself are written with a draft's K/V (junk
  the next step must overwrite) and their outputs are not checked.
* Discarded outputs (preempted, finished, aborted or failed-load requests):
  the kernel still runs, writes and reads; its outputs are computed and shown
  (``discarded``, with what they read) but never judged. The checker's
  property 2 does flag such a read when it was live at the time (a rejection
  shifted the step onto NULL, then a preemption discarded it).
* ``hazard = "unordered"`` (a KV-consumer connector loads on its own
  stream): the moment a block is back in the pool (its last reference
  dropped, and not hit again from the prefix cache later, which would mean
  nobody evicted it) the writer fills it with a foreign pattern, what a
  connector's load would leave. This is the hazard model of docs/DESIGN.md
  (such a writer "may write it at once"), so it applies even when the
  scheduler hands the block out again in the same call. A kernel of a step
  scheduled *before* that free sees the foreign pattern in the slots it reads
  there: where it wrote its own K/V, the load is taken to land between that
  write and the read (the worst interleaving of two unordered streams). Later
  owners' writes land as they run; a connector's load for a newly scheduled
  step lands at schedule time, before pending kernels run (with no step
  pending before it: after its own step's block copies, which the worker
  queues first on an idle stream).
  ``hazard = "ordered"`` (stream order): only kernels write, in step order,
  and a connector's load lands just before its own step's kernel; a kernel
  sees the writes of the steps that ran before it and its own.
* Mamba (assumption, as in :mod:`model.windows`): the recurrent state read by
  position ``t`` is modelled as reading the K/V of positions ``[t-1, t]``,
  in the blocks of their positions (a target that keeps Mamba states so: the
  reference; vLLM without prefix caching).
* Mamba in vLLM's ``align`` mode (prefix caching on, a target whose
  capabilities say ``mamba_align``): a real recurrence
  (:func:`confirm.attention_kernels.recur`) whose states live in the slots
  of the worker's table that :mod:`model.mamba_slots` names, as the checker
  reads them. A step reads the state it starts from (the slot its
  predecessor's acceptance picks, or a prefix hit's), runs the recurrence
  over its positions (a rejected draft's input is the draft pattern), and
  writes its running state and one state per draft into its ``1 + K`` slots
  in order (one block at two slots keeps the later); when its output is
  processed, the postprocess copies the accepted state at a block edge into
  the slot that edge closes. Judged: every accepted position's state
  against the dense recurrence over the true tokens, and each state the
  step leaves for the next one (its running state and its accepted drafts'),
  read back from its block after all writes of the step: one overwritten
  there garbles that position, at the step that left it (one written
  through NULL is dropped: NaN). Connector loads
  deliver the state at the load's end into its slot; block copies
  (``StepObs.copies``, of K/V and states alike) run before the step's loads
  and kernel (vLLM's ``_update_states`` before ``start_load_kv``).
* A block handed out afresh (not a prefix hit) holds junk from the moment
  the step it was allocated for runs (stream order, before that step's
  copies and loads): stale KV of another request would often equal the true
  KV here (prompts share tokens position by position), hiding a read of a
  block nobody wrote.
* One layer per group: a bad read garbles that position's output, not the
  K/V that deeper layers would write for it (a multi-layer model would also
  leave bad K/V behind, e.g. in a block the prefix cache serves later).

Usage::

    rep = replay_attention(Trace.load("traces/attention/x.json"))
    print(format_report(rep))       # rep.ok, rep.first_bad, rep.max_err, ...
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from confirm.attention_kernels import (
    KERNEL_TOL,
    TAG_DRAFT,
    TAG_FAILED,
    TAG_FOREIGN,
    TAG_UNINIT,
    DenseStates,
    PagedCache,
    Shape,
    StateCache,
    VllmKernel,
    attend,
    dense_reference,
    gather_paged,
    junk_kv,
    kv_true,
    load_vllm_kernel,
    pick_device,
    pick_dtype,
    q_true,
    recur,
    rid_stream,
    state_decay,
    state_inputs,
    window_grid,
)
from impl.target import Target, TargetCrash, Unsupported, make_target
from model.events import AddRequest, Config, Trace
from model.mamba_slots import checkpoint_copy, start_slot, worker_slots, written
from model.observations import (
    NULL,
    AllocObs,
    CopyObs,
    FinishObs,
    FreeObs,
    Item,
    ProcessObs,
    ReqStep,
    StepObs,
)
from model.windows import reads


class AttentionError(ValueError):
    """The observation stream cannot be executed (e.g. out-of-order processing)."""


@dataclass(frozen=True)
class StepRow:
    """One request's part of one executed step."""

    step: int
    request: str
    positions: tuple[int, int]  # [a, b) checked: shifts applied, rejected drafts left out
    max_abs_err: float  # over finite outputs, all groups
    nan_reads: int  # (position, group) rows whose window read a NaN
    verdict: str  # ok | nan | garbled | discarded
    note: str = ""
    kernel_err: float | None = None  # vLLM's kernel against the torch paged path


@dataclass(frozen=True)
class BadRead:
    step: int
    rid: str
    position: int
    kind: str  # "nan" | "garbled"
    group: int = 0
    err: float = float("nan")
    group_label: str = ""
    where: str = ""  # what was read, where it is not the position's own output

    def __str__(self) -> str:
        what = "read NaN (NULL block)" if self.kind == "nan" else (
            f"garbled (error {self.err:.3g})")
        g = f"group {self.group}" + (f" {self.group_label}" if self.group_label else "")
        where = f", {self.where}" if self.where else ""
        return f"step {self.step}, {self.rid} position {self.position} ({g}){where}: {what}"


@dataclass
class AttentionReport:
    label: str
    rows: list[StepRow]
    device: str
    kernel: str
    dtype: str
    tol: float
    first_bad: BadRead | None = None
    max_err: float = 0.0
    nan_reads: int = 0
    steps: int = 0
    positions: int = 0  # (position, group) rows checked
    null_writes: int = 0  # computed positions whose K/V write hit a NULL entry (dropped)
    foreign_writes: int = 0  # blocks the unordered writer filled
    discarded_bad: int = 0  # discarded outputs that read NaN or garbage (not judged)
    state_reads: int = 0  # align-mode Mamba: steps that started from a state in a block
    checkpoints: int = 0  # align-mode Mamba: postprocess copies at a block edge
    kernel_max_err: float | None = None
    kernel_tol: float | None = None
    kernel_note: str = ""  # why vLLM's kernel did not run, if it did not
    kernel_failed: str = ""  # vLLM's kernel raised (the torch check went on)
    property_violation: str = ""  # the first property violation replay found, if any
    violations: list = field(default_factory=list)  # all of them (properties.invariants)
    seconds: float = 0.0

    def named_step(self, prop: int) -> int | None:
        """The step that the checker's first violation of property ``prop`` names."""
        for v in self.violations:
            if v.prop == prop and v.step is not None:
                return v.step
        return None

    @property
    def ok(self) -> bool:
        """No step read NULL or overwritten KV (max error within tolerance, no NaN)."""
        return self.first_bad is None

    @property
    def kernel_ok(self) -> bool | None:
        """vLLM's kernel agreed with the torch path (None: it did not run)."""
        if self.kernel_max_err is None:
            return None
        return self.kernel_max_err <= (self.kernel_tol or 0.0)


# ------------------------------------------------------------------- the replay


@dataclass
class _Req:
    rs: ReqStep
    gen: int = 0  # the request's preemptions before this step was scheduled
    shift: int = 0
    dead: str = ""  # why the output will be discarded, "" while it counts
    prev: _Req | None = None  # the request's step before it (align-mode Mamba states)

    @property
    def end(self) -> int:
        return self.rs.end - self.shift


@dataclass
class _Step:
    step: int
    reqs: list[_Req]
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst) run before its kernel
    # requests whose loads land when it runs, after its copies (nothing pending
    # before it, or a copy of the step reads a block the load fills)
    load_late: set[str] = field(default_factory=set)
    # (group, block) handed out afresh for it: undefined until written, junk when it runs
    fresh: list[tuple[int, int]] = field(default_factory=list)
    # (group, block) a copy of it held, back in the pool before it runs: the
    # unordered writer takes them after its copies (issued after them)
    after_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Stats:
    rows: list[StepRow] = field(default_factory=list)
    first_bad: BadRead | None = None
    max_err: float = 0.0
    nan_reads: int = 0
    positions: int = 0
    null_writes: int = 0
    foreign_writes: int = 0
    discarded_bad: int = 0
    state_reads: int = 0
    checkpoints: int = 0
    kernel_max_err: float | None = None
    steps: int = 0


class AttentionReplay:
    """Executes an observation stream on paged KV caches (one per group)."""

    def __init__(self, cfg: Config, prompt_lens: dict[str, int], device: torch.device,
                 dtype: str = "fp32", shape: Shape | None = None,
                 kernel: VllmKernel | None = None, mamba_align: bool = False):
        self.cfg = cfg
        self.Bs = cfg.block_sizes  # per group: tokens per block
        self.prompt_lens = prompt_lens
        self.device = device
        self.dtype_name = dtype
        self.dtype, self.tol = pick_dtype(dtype)
        self.shape = shape or Shape()
        self.kernel = kernel
        self.kernel_failed = ""  # vLLM's kernel raised: why (it is not run again)
        self.caches = [PagedCache(cfg.num_blocks, B, self.shape, gi, device, self.dtype)
                       for gi, B in enumerate(self.Bs)]
        # align-mode Mamba groups: states in the worker's slots (model.mamba_slots)
        self.states = {gi: StateCache(cfg.num_blocks, self.shape, gi, device, self.dtype)
                       for gi, g in enumerate(cfg.groups)
                       if mamba_align and worker_slots(cfg) and g.spec.holds_state}
        self.decay = {gi: state_decay(gi, self.shape).to(device) for gi in self.states}
        self.dense = DenseStates(self.shape)
        self.last: dict[str, _Req] = {}  # rid -> its last scheduled step (align-mode Mamba)
        self.unordered = cfg.hazard == "unordered"
        self.pending: list[_Step] = []
        self.fresh: list[tuple[int, int]] = []  # handed out afresh, for the next step
        self.copy_freed: list[tuple[int, int]] = []  # returned by a copy's free this event
        self.fresh_salt = 0
        self.refs: Counter[tuple[int, int]] = Counter()
        self.gen: Counter[str] = Counter()  # preemptions per request
        self.scheduled = 0  # steps scheduled so far
        # (group, block) -> (steps scheduled when the unordered writer took it, salt)
        self.taken: dict[tuple[int, int], tuple[int, int]] = {}
        # (group, block) -> slots the running kernel wrote
        self.touched: dict[tuple[int, int], set[int]] = defaultdict(set)
        self.st = _Stats()

    # ------------------------------------------------------------ driving

    def run(self, events_items: list[list[Item]]) -> _Stats:
        """Execute the items of every event (one list per event, in order)."""
        self.failed_at = _failed_loads(events_items)
        self.foreign_ok = _foreign_ok(events_items)
        for ei, items in enumerate(events_items):
            self._event(ei, items)
        while self.pending:
            self._execute(self.pending.pop(0), None)
        return self.st

    def _event(self, ei: int, items: list[Item]) -> None:
        scheduled: list[_Step] = []
        for ii, it in enumerate(items):
            if isinstance(it, StepObs):
                s = _Step(it.step, [_Req(rs, self.gen[rs.rid]) for rs in it.reqs],
                          it.copies)
                for r in s.reqs:
                    r.prev, self.last[r.rs.rid] = self.last.get(r.rs.rid), r
                self.pending.append(s)
                scheduled.append(s)
                self.scheduled = max(self.scheduled, it.step + 1)
            elif isinstance(it, AllocObs):
                self.refs[(it.group, it.block)] += 1
                if not it.cached and it.block != NULL:
                    self.fresh.append((it.group, it.block))
            elif isinstance(it, CopyObs):
                # the copy holds both blocks until it ran (its ``copy`` frees); a
                # hit's slot moving to dst: the request's reference of src is the
                # copy's, and the request holds dst
                self.refs[(it.group, it.src)] += it.logical < 0
                self.refs[(it.group, it.dst)] += 1 + (it.logical >= 0)
            elif isinstance(it, FreeObs):
                self._free(it, (ei, ii))
            elif isinstance(it, ProcessObs):
                if not self.pending:
                    raise AttentionError(f"output of step {it.step} processed, none in flight")
                s = self.pending.pop(0)
                if s.step != it.step:
                    raise AttentionError(
                        f"step {it.step} processed while step {s.step} is the oldest in flight")
                self._execute(s, it)
            elif isinstance(it, FinishObs):
                self._kill(it.rid, it.reason)
        if scheduled and self.fresh:
            scheduled[0].fresh, self.fresh = self.fresh, []
        # a block a copy held, returned before the copy ran (vLLM at depth 1 frees
        # the copy's holds in the schedule that queues it): with nothing pending
        # ahead of the copy's step, the copy runs before any write issued later
        first = scheduled[0] if scheduled and scheduled[0] is self.pending[0] else None
        copied = {b for ab in first.copies for b in ab} if first else set()
        for key in self.copy_freed:
            if key[1] in copied:
                first.after_copies.append(key)
            else:
                self._take(key)
        self.copy_freed = []
        if self.unordered:
            # a connector's load is issued with the schedule, on its own stream:
            # it lands before any pending kernel runs. The worker queues the
            # step's block copies before it issues the load: with no step pending
            # ahead, the copies run first; a copy of a block the load fills runs
            # first in the worst interleaving
            for s in scheduled:
                srcs = {a for a, _ in s.copies}
                for r in s.reqs:
                    if s is self.pending[0] or srcs & self._loaded_blocks(r.rs):
                        s.load_late.add(r.rs.rid)
                self._undefined(s)
                for r in s.reqs:
                    if r.rs.rid not in s.load_late:
                        self._load(s.step, r.rs)

    def _free(self, f: FreeObs, where: tuple[int, int]) -> None:
        key = (f.group, f.block)
        self.refs[key] -= 1
        if f.reason not in ("window", "copy"):  # a copy's hold: not the request's end
            self._kill(f.rid, f.reason)
        if f.reason == "preempt":
            self.gen[f.rid] += 1  # steps scheduled from now on belong to the restart
        if (self.unordered and f.block != NULL and self.refs[key] <= 0
                and self.foreign_ok.get(where, True)):
            if f.reason == "copy":
                self.copy_freed.append(key)  # decided with the event's step
                return
            self._take(key)

    def _take(self, key: tuple[int, int]) -> None:
        """The unordered writer fills a block back in the pool."""
        self.taken[key] = (self.scheduled, self.st.foreign_writes)
        self._fill_foreign(key, np.arange(self.Bs[key[0]]))
        self.st.foreign_writes += 1

    def _undefined(self, s: _Step) -> None:
        """Blocks handed out afresh for ``s`` hold what they held before: stale KV
        of any other request (vLLM zeroes them only where a backend needs it),
        here junk, written in stream order when ``s`` runs, before its copies and
        loads: a read of one before it is written shows."""
        for gi, block in s.fresh:
            self.fresh_salt += 1
            if gi in self.states:
                self.states[gi].fill(block, TAG_UNINIT, block, self.fresh_salt)
                continue
            slots = np.arange(self.Bs[gi])
            k, v = junk_kv(TAG_UNINIT, block, gi, slots, self.shape, salt=self.fresh_salt)
            self.caches[gi].write(torch.full((len(slots),), block, device=self.device),
                                  torch.from_numpy(slots).to(self.device), k, v)
        s.fresh = []

    def _fill_foreign(self, key: tuple[int, int], slots: np.ndarray) -> None:
        group, block = key
        if group in self.states:
            self.states[group].fill(block, TAG_FOREIGN, block, self.taken[key][1])
            return
        k, v = junk_kv(TAG_FOREIGN, block, group, slots, self.shape, salt=self.taken[key][1])
        self.caches[group].write(torch.full((len(slots),), block, device=self.device),
                                 torch.from_numpy(slots).to(self.device), k, v)

    def _kill(self, rid: str, why: str) -> None:
        self.last.pop(rid, None)  # a restart starts from no step of its own
        for s in self.pending:
            for r in s.reqs:
                if r.rs.rid == rid and not r.dead:
                    r.dead = why

    # ------------------------------------------------------------ the device

    def _write(self, gi: int, table: tuple[int, ...], pos: np.ndarray, k: torch.Tensor,
               v: torch.Tensor, count_null: bool = True) -> None:
        if len(pos) == 0:
            return
        B = self.Bs[gi]
        logical = pos // B
        ext = np.array(list(table) + [NULL], dtype=np.int64)
        phys = ext[np.minimum(logical, len(table))]
        ok = phys != NULL
        if count_null:
            self.st.null_writes += int((~ok).sum())
        if not ok.any():
            return
        okt = torch.from_numpy(ok)
        for b, sl in zip(phys[ok].tolist(), (pos[ok] % B).tolist(), strict=True):
            self.touched[(gi, b)].add(sl)
        self.caches[gi].write(torch.from_numpy(phys[ok]).to(self.device),
                              torch.from_numpy(pos[ok] % B).to(self.device),
                              k[okt], v[okt])

    def _loaded_blocks(self, rs: ReqStep) -> set[int]:
        """The blocks a connector's load of ``rs`` fills (any group)."""
        out: set[int] = set()
        if rs.loaded <= 0:
            return out
        for gi, B in enumerate(self.Bs):
            table = _table(rs, gi)
            for lb in range((rs.start - rs.loaded) // B, (rs.start - 1) // B + 1):
                if lb < len(table) and table[lb] != NULL:
                    out.add(table[lb])
        return out

    def _load(self, step: int, rs: ReqStep) -> None:
        """A connector's load of positions ``[start - loaded, start)``; from the
        first bad block on (a failed load) it leaves junk."""
        if rs.loaded <= 0:
            return
        plen = self.prompt_lens.get(rs.rid, 0)
        pos = np.arange(rs.start - rs.loaded, rs.start)
        bad_from = self.failed_at.get((step, rs.rid))
        for gi in range(len(self.cfg.groups)):
            if gi in self.states:
                self._load_state(gi, rs, plen, bad_from is not None
                                 and (rs.start - 1) // self.cfg.block_size >= bad_from, step)
                continue
            k, v = kv_true(plen, gi, pos, self.shape)
            if bad_from is not None:
                bad = torch.from_numpy(pos // self.cfg.block_size >= bad_from)[:, None, None]
                jk, jv = junk_kv(TAG_FAILED, rid_stream(rs.rid), gi, pos, self.shape, salt=step)
                k, v = torch.where(bad, jk, k), torch.where(bad, jv, v)
            # positions a window already skipped have NULL slots: nothing to load
            self._write(gi, _table(rs, gi), pos, k, v, count_null=False)

    def _execute(self, s: _Step, po: ProcessObs | None) -> None:
        accepted = dict(po.accepted) if po else {}
        discarded = set(po.discarded) if po else set()
        failed = dict(po.failed) if po else {}
        self.st.steps += 1
        self.touched.clear()
        plan = []
        self._undefined(s)
        # 1. the worker's block copies (with its state update, before the connector
        # starts its loads), one gather then one scatter, in every cache
        # (a block id is one group's at a time; the others copy junk into junk)
        if s.copies:
            got = {gi: [st.read(a) for a, _ in s.copies] for gi, st in self.states.items()}
            src = torch.tensor([a for a, _ in s.copies], device=self.device)
            dst = torch.tensor([b for _, b in s.copies], device=self.device)
            kv = [(c.k[src].clone(), c.v[src].clone()) for c in self.caches]
            for gi, st in self.states.items():
                for (_, b), h in zip(s.copies, got[gi], strict=True):
                    st.write(b, h)
            for c, (k, v) in zip(self.caches, kv, strict=True):
                c.k[dst], c.v[dst] = k, v
        for key in s.after_copies:
            if self.refs[key] <= 0:  # not handed out again meanwhile
                self._take(key)
        # then loads (ordered: on the compute stream, just before the kernel)
        for r in s.reqs:
            if not self.unordered or r.rs.rid in s.load_late:
                self._load(s.step, r.rs)
        # 2. every request's new K/V, through the tables the step was scheduled with
        states = []
        for r in s.reqs:
            rs, rid = r.rs, r.rs.rid
            plen = self.prompt_lens.get(rid, 0)
            dead = r.dead or ("failed load" if rid in failed else
                              "discarded" if rid in discarded else "")
            rejected = 0 if dead else max(0, rs.spec - accepted.get(rid, rs.spec))
            a, b = rs.start - r.shift, rs.end - r.shift
            good = np.arange(a, b - rejected)
            drafts = np.arange(b - rejected, b)
            for gi in range(len(self.cfg.groups)):
                if gi in self.states:
                    states.append(self._run_state(s.step, r, gi, plen, a, b, rejected))
                    continue
                k, v = kv_true(plen, gi, good, self.shape)
                self._write(gi, _table(rs, gi), good, k, v)
                if len(drafts):
                    jk, jv = junk_kv(TAG_DRAFT, rid_stream(rid), gi, drafts, self.shape,
                                     salt=s.step)
                    self._write(gi, _table(rs, gi), drafts, jk, jv)
            plan.append((r, dead, rejected, good))
        # the unordered writer's load lands between this kernel's writes and its
        # reads in blocks returned to the pool after the step was scheduled
        for key, slots in self.touched.items():
            if key in self.taken and s.step < self.taken[key][0]:
                self._fill_foreign(key, np.array(sorted(slots), dtype=np.int64))
        self.touched.clear()
        judged = self._judge_states(states)
        # 3. attention for every computed position whose output counts
        for r, dead, rejected, good in plan:
            rid = r.rs.rid
            extra = judged.get(id(r))
            note = []
            if r.shift:
                note.append(f"shifted -{r.shift}")
            if rejected:
                note.append(f"{rejected} draft(s) rejected")
            if len(good) == 0:
                self.st.rows.append(StepRow(s.step, rid, (0, 0), 0.0, 0, "discarded",
                                            dead or "nothing computed"))
            elif dead:
                # the kernel still reads; what it reads is shown, never judged
                row = self._attend(s.step, r.rs, good, "; ".join([dead, *note]), judge=False,
                                   extra=extra)
                if row.nan_reads or row.max_abs_err > self.tol:
                    self.st.discarded_bad += 1
                self.st.rows.append(row)
            else:
                self.st.rows.append(self._attend(s.step, r.rs, good, "; ".join(note),
                                                 extra=extra))
        # the postprocess: an accepted state at a block edge into the slot it closes
        # (the worker's, after sampling: a step never processed, at the trace's
        # end, ran it too, all its drafts accepted)
        for r, dead, rejected, _ in plan:
            if not dead:
                self._checkpoint(r, rejected)
        # 4. rejections move this request's later in-flight steps down
        for r, _dead, rejected, _ in plan:
            rid = r.rs.rid
            if rid in failed:
                self.last.pop(rid, None)  # it recomputes from what the recovery says
            for later in self.pending:
                for lr in later.reqs:
                    if lr.rs.rid != rid:
                        continue
                    if rejected:
                        lr.shift += rejected
                    # a discarded output takes the request's later in-flight steps
                    # along, but not those of a restart after a preemption
                    if (rid in failed or rid in discarded) and lr.gen == r.gen:
                        lr.dead = lr.dead or ("failed load" if rid in failed else "discarded")

    # ------------------------------------------------ align-mode Mamba states

    def _load_state(self, gi: int, rs: ReqStep, plen: int, failed: bool, step: int) -> None:
        """A connector's load delivers the state after its last position into
        that position's slot (junk where the load failed)."""
        slot = (rs.start - 1) // self.Bs[gi]
        table = _table(rs, gi)
        if rs.start <= 0 or slot >= len(table) or table[slot] == NULL:
            return
        st = self.states[gi]
        if failed:
            st.fill(table[slot], TAG_FAILED, rid_stream(rs.rid), step)
        else:
            st.write(table[slot], self.dense.after(plen, gi, np.array([rs.start - 1]))[0])

    def _run_state(self, step: int, r: _Req, gi: int, plen: int, a: int, b: int,
                   rejected: int) -> _StateRun:
        """One request's recurrence in group ``gi``: read the state it starts
        from, run its positions ``[a, b)``, write its ``1 + K`` states."""
        B, table, st, rid = self.Bs[gi], _table(r.rs, gi), self.states[gi], r.rs.rid
        q = r.prev
        slot = start_slot(a, B) if q is None else start_slot(a, B, q.end, q.rs.spec)
        if slot is None:
            h0 = torch.zeros(self.shape.width, device=self.device)
        else:
            h0 = st.read(table[slot] if slot < len(table) else NULL)
            self.st.state_reads += 1
        xs = state_inputs(kv_true(plen, gi, np.arange(a, b - rejected), self.shape))
        if rejected:
            drafts = np.arange(b - rejected, b)
            jk_jv = junk_kv(TAG_DRAFT, rid_stream(rid), gi, drafts, self.shape, salt=step)
            xs = torch.cat([xs, state_inputs(jk_jv)])
        hs = recur(h0, xs.to(self.device), self.decay[gi])
        for sl, t in written(b, r.rs.spec, B):
            if sl < len(table) and table[sl] != NULL:
                st.write(table[sl], hs[t - a] if t >= a else h0)
                self.touched[(gi, table[sl])].add(0)
        return _StateRun(r, gi, plen, a, b, rejected, hs, table)

    def _judge_states(self, runs: list[_StateRun]) -> dict[int, tuple[float, int, BadRead | None]]:
        """Per request (``id`` of its :class:`_Req`): the worst error, the NaN
        rows and the first bad position over its accepted positions' states
        and the states it left for the next step (read back after all writes
        of the step)."""
        out: dict[int, tuple[float, int, BadRead | None]] = {}
        for run in runs:
            r, gi = run.r, run.gi
            B, st, label = self.Bs[gi], self.states[gi], self.cfg.groups[gi].label()
            n = run.b - run.rejected - run.a
            pos = np.arange(run.a, run.a + n)
            got = [run.hs[:n].float().cpu()]
            where = [""] * n
            for sl, t in written(run.b, r.rs.spec, B):
                if not run.a <= t < run.a + n:
                    continue
                # a state written through NULL is dropped: the next step reads NULL there
                blk = run.table[sl] if sl < len(run.table) else NULL
                got.append(st.read(blk).cpu()[None])
                pos = np.append(pos, t)
                where.append(f"the state after it left at slot {sl} (block {blk}) for the "
                             f"next step")
            g = torch.cat(got)
            ref = self.dense.after(run.plen, gi, pos)
            isnan = torch.isnan(g).any(1)
            err = torch.where(isnan, torch.zeros(()), (g - ref).abs().amax(1))
            worst, nan_rows, bad = float(err.max()) if len(err) else 0.0, 0, None
            nan_rows = int(isnan.sum())
            for i in (isnan | (err > self.tol)).nonzero().flatten().tolist():
                cand = BadRead(0, r.rs.rid, int(pos[i]),
                               "nan" if bool(isnan[i]) else "garbled", gi,
                               float("nan") if bool(isnan[i]) else float(err[i]), label,
                               where[i])
                if bad is None or cand.position < bad.position:
                    bad = cand
            w0, n0, b0 = out.get(id(r), (0.0, 0, None))
            if b0 is not None and (bad is None or b0.position <= bad.position):
                bad = b0
            out[id(r)] = (max(w0, worst), n0 + nan_rows, bad)
        return out

    def _checkpoint(self, r: _Req, rejected: int) -> None:
        """The postprocess of a processed step: the state after the block edge
        its count reached, into the slot of the block that edge closes."""
        for gi, st in self.states.items():
            table = _table(r.rs, gi)
            cp = checkpoint_copy(r.end, r.rs.spec, r.end - rejected, self.Bs[gi])
            if cp is None:
                continue
            src, dest = cp
            if src < len(table) and dest < len(table) and NULL not in (table[src], table[dest]):
                st.write(table[dest], st.read(table[src]))
                self.st.checkpoints += 1

    # ------------------------------------------------------------ attention

    def _attend(self, step: int, rs: ReqStep, ts: np.ndarray, note: str,
                judge: bool = True,
                extra: tuple[float, int, BadRead | None] | None = None) -> StepRow:
        rid = rs.rid
        plen = self.prompt_lens.get(rid, 0)
        worst = 0.0
        nan_rows = 0
        bad: BadRead | None = None
        kerr: float | None = None
        if extra is not None:  # the align-mode Mamba groups' states (_judge_states)
            worst, nan_rows, bad = extra
            if bad is not None:
                bad = replace(bad, step=step)
        for gi, g in enumerate(self.cfg.groups):
            if gi in self.states:
                continue
            table = _table(rs, gi)
            spans = [reads(g, int(t), plen) for t in ts]
            lo = np.array([sp[0][0] for sp in spans], dtype=np.int64)
            pos, mask = window_grid(lo, ts)
            if any(len(sp) > 1 for sp in spans):  # R-SWA: the prompt and the recent window
                inside = np.zeros_like(mask)
                for i, sp in enumerate(spans):
                    for x, y in sp:
                        inside[i] |= (pos[i] >= x) & (pos[i] < y)
                mask &= inside
            q = q_true(plen, gi, ts, self.shape)
            cache = self.caches[gi]
            got = gather_paged(cache, table, pos, mask)
            out = attend(q, got, self.dtype)
            ref = dense_reference(plen, gi, q, pos, mask, self.shape, self.device,
                                  self.dtype)
            isnan = torch.isnan(out).flatten(1).any(1) | got.nan_rows
            err = (out - ref).abs().flatten(1).amax(1)
            err = torch.where(isnan, torch.zeros_like(err), err)
            nan_rows += int(isnan.sum())
            worst = max(worst, float(err.max()))
            badrows = (isnan | (err > self.tol)).nonzero().flatten().tolist()
            if badrows:
                i = badrows[0]
                cand = BadRead(step, rid, int(ts[i]), "nan" if bool(isnan[i]) else "garbled",
                               gi, float("nan") if bool(isnan[i]) else float(err[i]),
                               g.label())
                if bad is None or cand.position < bad.position:
                    bad = cand
            if self.kernel is not None and judge and g.spec.kernel_window() is not None:
                try:
                    e = self._kernel_err(cache, g, table, ts, q, pos, mask)
                except Exception as ex:  # noqa: BLE001 - reported, the torch check goes on
                    self.kernel_failed = f"{type(ex).__name__}: {ex}"[:200]
                    self.kernel = None
                else:
                    kerr = e if kerr is None else max(kerr, e)
        if not judge:
            what = (f"; read NaN at {nan_rows}" if nan_rows else
                    f"; read garbage (error {worst:.3g})" if worst > self.tol else "")
            return StepRow(step, rid, (int(ts[0]), int(ts[-1]) + 1), worst, nan_rows,
                           "discarded", note + what)
        self.st.positions += len(ts) * len(self.cfg.groups)
        self.st.nan_reads += nan_rows
        self.st.max_err = max(self.st.max_err, worst)
        if kerr is not None:
            self.st.kernel_max_err = max(self.st.kernel_max_err or 0.0, kerr)
        if bad is not None and self.st.first_bad is None:
            self.st.first_bad = bad
        verdict = "ok" if bad is None else ("nan" if nan_rows else "garbled")
        return StepRow(step, rid, (int(ts[0]), int(ts[-1]) + 1), worst, nan_rows, verdict,
                       note, kerr)

    def _kernel_err(self, cache: PagedCache, g, table, ts, q, pos, mask) -> float:
        """vLLM's kernel and the torch paged path on the same cache and table,
        the NULL block zeroed as in vLLM (a tile may touch slots outside a
        window: 0 * NaN would be NaN there while the window reads nothing)."""
        cache.zero_null()
        try:
            mine = attend(q, gather_paged(cache, table, pos, mask), self.dtype)
            theirs = self.kernel.run(cache, g.spec, table, ts, q)
        finally:
            cache.poison_null()
        d = (mine - theirs).abs()
        if torch.isnan(d).any():
            return float("inf")
        return float(d.max())


@dataclass
class _StateRun:
    """One request's recurrence in one align-mode Mamba group of a step."""

    r: _Req
    gi: int
    plen: int
    a: int
    b: int
    rejected: int
    hs: torch.Tensor  # the states after a .. b - 1
    table: tuple[int, ...]


def _table(rs: ReqStep, gi: int) -> tuple[int, ...]:
    return rs.tables[gi] if gi < len(rs.tables) else ()


def _failed_loads(events_items: list[list[Item]]) -> dict[tuple[int, str], int]:
    out = {}
    for items in events_items:
        for it in items:
            if isinstance(it, ProcessObs):
                for rid, k in it.failed:
                    out[(it.step, rid)] = k
    return out


def _foreign_ok(events_items: list[list[Item]]) -> dict[tuple[int, int], bool]:
    """For each free: may the unordered writer take the block? Not when the
    block's next hand-out is a prefix-cache hit (then nobody evicted it)."""
    nxt: dict[tuple[int, int], bool] = {}
    out: dict[tuple[int, int], bool] = {}
    for ei in range(len(events_items) - 1, -1, -1):
        items = events_items[ei]
        for ii in range(len(items) - 1, -1, -1):
            it = items[ii]
            if isinstance(it, AllocObs):
                nxt[(it.group, it.block)] = it.cached
            elif isinstance(it, FreeObs):
                out[(ei, ii)] = not nxt.get((it.group, it.block), False)
    return out


# ------------------------------------------------------------------- front door


def prompt_lengths(trace: Trace) -> dict[str, int]:
    return {e.id: e.prompt_len for e in trace.events if isinstance(e, AddRequest)}


def run_observations(cfg: Config, prompt_lens: dict[str, int], events_items: list[list[Item]],
                     device: str | torch.device | None = None, dtype: str = "fp32",
                     heads: int = 2, head_dim: int = 8,
                     vllm: bool | VllmKernel | None = None, label: str = "",
                     mamba_align: bool = False) -> AttentionReport:
    """Execute an observation stream (one item list per event). ``vllm``:
    None runs vLLM's kernel where it can (CUDA with vLLM), True requires it,
    False never runs it; a :class:`VllmKernel` is used as given.
    ``mamba_align``: the target keeps Mamba states in the worker's slots with
    prefix caching on (vLLM's align mode; :attr:`impl.target.Capabilities.mamba_align`)."""
    t0 = time.perf_counter()
    dev = pick_device(device)
    _, tol = pick_dtype(dtype)
    shape = Shape(heads, head_dim)
    if isinstance(vllm, VllmKernel):
        kernel, why = vllm, ""
    elif vllm is False:
        kernel, why = None, "not asked for"
    else:
        kernel, why = load_vllm_kernel(dev, shape)
    if vllm is True and kernel is None:
        raise RuntimeError(f"vLLM's kernel was required: {why}")
    rp = AttentionReplay(cfg, prompt_lens, dev, dtype, shape, kernel, mamba_align)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        # the tensors are tiny: intra-op threads only add wake-up latency (and
        # spin against each other on a busy 2-core machine)
        torch.set_num_threads(1)
    try:
        st = rp.run(events_items)
    finally:
        torch.set_num_threads(threads)
    name = f"torch paged ({dev.type})"
    if kernel is not None:
        name += f" + {kernel.name}"
    return AttentionReport(
        label=label or cfg.label(), rows=st.rows, device=_device_name(dev), kernel=name,
        dtype=dtype, tol=tol, first_bad=st.first_bad, max_err=st.max_err,
        nan_reads=st.nan_reads, steps=st.steps, positions=st.positions,
        null_writes=st.null_writes, foreign_writes=st.foreign_writes,
        discarded_bad=st.discarded_bad, state_reads=st.state_reads, checkpoints=st.checkpoints,
        kernel_max_err=st.kernel_max_err,
        kernel_tol=KERNEL_TOL[dtype] if kernel is not None else None,
        kernel_note=why, kernel_failed=rp.kernel_failed, seconds=time.perf_counter() - t0)


def replay_attention(trace: Trace, target_spec: str | Target = "reference",
                     device: str | torch.device | None = None, dtype: str = "fp32", *,
                     heads: int = 2, head_dim: int = 8,
                     vllm: bool | VllmKernel | None = None) -> AttentionReport:
    """Replay ``trace`` on the target and push what it observed through paged
    attention on ``device`` (default: CUDA when present, else CPU)."""
    from properties.replay import replay

    for g in trace.config.groups:
        if not g.spec.reads_positions:
            raise Unsupported(f"the attention replay reads positions' KV; {g.label()}'s "
                              "blocks hold none (a ring, or the encoder's outputs): "
                              "properties 1-5 and 7 judge it")
    t0 = time.perf_counter()
    target = make_target(target_spec) if isinstance(target_spec, str) else target_spec
    rr = replay(trace, target, stop_at_first=False)
    if rr.crash:
        raise TargetCrash(rr.crash)
    events_items = [row.obs.items for row in rr.rows]
    rep = run_observations(trace.config, prompt_lengths(trace), events_items, device, dtype,
                           heads, head_dim, vllm, label=trace.config.label(),
                           mamba_align=target.capabilities.mamba_align)
    if rr.first is not None:
        rep.property_violation = str(rr.first)
    rep.violations = list(rr.violations)
    rep.seconds = time.perf_counter() - t0
    return rep


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return "cpu"


# ------------------------------------------------------------------- reporting


def format_report(rep: AttentionReport, max_rows: int = 12) -> str:
    """A short table: the verdict first, then the steps around the first bad one."""
    lines = []
    verdict = "CLEAN" if rep.ok else ("NaN READ" if rep.first_bad.kind == "nan" else "GARBLED")
    lines.append(f"attention: {verdict}  ({rep.label})")
    lines.append(f"  device {rep.device}, {rep.kernel}, {rep.dtype} (tol {rep.tol:g}); "
                 f"{rep.steps} steps, {rep.positions} position-reads, {rep.seconds:.2f}s")
    lines.append(f"  max error {rep.max_err:.3g}, NaN reads {rep.nan_reads}"
                 + (f", writes to NULL dropped {rep.null_writes}" if rep.null_writes else "")
                 + (f", blocks overwritten by the unordered writer {rep.foreign_writes}"
                    if rep.foreign_writes else "")
                 + (f", discarded outputs that read NaN/garbage {rep.discarded_bad} (not judged)"
                    if rep.discarded_bad else ""))
    if rep.state_reads or rep.checkpoints:
        lines.append(f"  Mamba states in the worker's slots: {rep.state_reads} read from a block, "
                     f"{rep.checkpoints} copied at a block edge")
    if rep.kernel_failed:
        lines.append(f"  vLLM kernel FAILED: {rep.kernel_failed}")
    if rep.kernel_max_err is not None:
        lines.append(f"  vLLM kernel vs torch: max diff {rep.kernel_max_err:.3g} "
                     f"(tol {rep.kernel_tol:g}) {'agrees' if rep.kernel_ok else 'DISAGREES'}")
    elif rep.kernel_note and rep.device != "cpu":
        lines.append(f"  vLLM kernel: {rep.kernel_note}")
    if rep.first_bad is not None:
        lines.append(f"  first bad: {rep.first_bad}")
    if rep.property_violation:
        fb = rep.first_bad
        same = [v for v in rep.violations if fb is not None and v.step == fb.step
                and v.prop == (2 if fb.kind == "nan" else 1)]
        lines.append(f"  checker:   {same[0] if same else rep.property_violation}")
    rows = rep.rows
    if len(rows) > max_rows:
        bad_i = next((i for i, r in enumerate(rows) if r.verdict in ("nan", "garbled")), None)
        centre = bad_i if bad_i is not None else 0
        lo = max(0, min(centre - max_rows // 3, len(rows) - max_rows))
        shown = rows[lo:lo + max_rows]
        skipped = (lo, len(rows) - lo - len(shown))
    else:
        shown, skipped = rows, (0, 0)
    w = max([len(r.request) for r in shown] + [7])
    lines.append(f"  {'step':>4}  {'request':<{w}}  {'positions':>11}  {'max err':>9}  "
                 f"{'NaN':>4}  verdict")
    if skipped[0]:
        lines.append(f"  {'...':>4}  ({skipped[0]} earlier rows)")
    for r in shown:
        mark = ">>" if r.verdict in ("nan", "garbled") else "  "
        pos = f"[{r.positions[0]},{r.positions[1]})"
        err = f"{r.max_abs_err:.2e}"
        extra = f"  {r.note}" if r.note else ""
        lines.append(f"{mark}{r.step:>4}  {r.request:<{w}}  {pos:>11}  {err:>9}  "
                     f"{r.nan_reads:>4}  {r.verdict}{extra}")
    if skipped[1]:
        lines.append(f"  {'...':>4}  ({skipped[1]} later rows)")
    return "\n".join(lines)
