"""Proofs, refutations and the admission bound, on the Z3 model of
:mod:`prove.z3model`.

``prove_all()`` judges every (kind, policy):

* **proved**: the invariant of :func:`prove.z3model.safety_invariant` ("a
  block is freed only when it is outside every unprocessed step's window and
  no rollback can make it needed again", and no live step ever reads a NULL
  slot of its table) holds initially and is preserved by every transition,
  each checked on its own (Ivy style) for symbolic parameters;
* **refuted**: induction fails, and a bounded search from the initial state
  (concrete scheduler: one request, chunked prefill, ``1 + spec`` tokens per
  decode) finds a short run that frees a block an unprocessed step reads
  (property 1) or, after a rejection, has a step read a block that was NULL in
  its table (property 2). The run comes back as a :class:`model.events.Trace`
  that ``./kvcheck replay`` runs on any target;
* **unknown**: neither (a counterexample to induction is shown).

``admission_bounds()`` proves, per kind, that ``windows.live_bound(g, B,
max_model_len, D*M)`` is never exceeded under ``settled``, what the real
maximum is and that a run reaches it, and compares with the pre-fix sizing
(``tokens_ahead = M``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import z3

from model.events import AddRequest, Config, Group, Process, Schedule, Trace
from model.kinds import KINDS as KIND_CLASSES
from model.policy import REGISTRY, Counts
from model.windows import live_bound as code_live_bound

from .z3_arith import Arith, check_nonlinear, hint, prove_lemmas, zmax, zmin
from .z3model import (
    RUN,
    Z3_KINDS,
    Invariant,
    Params,
    PolicyNotSymbolic,
    Rule,
    State,
    Trans,
    bound_invariant,
    exact_bound,
    fresh_state,
    init_state,
    make_params,
    policy_rule,
    safety_invariant,
    skipped,
    t_finish,
    t_free_only,
    t_preempt,
    t_process,
    t_process_discarded,
    t_process_failed_load,
    t_schedule,
    violation_p1,
    violation_p2,
    window_lo,
    z3_kind,
)

STEP_TIMEOUT_MS = 60_000
SEARCH_TIMEOUT_MS = 10_000
MAX_TRACE_EVENTS = 6
MAX_DEPTH = 4  # Config.validate's limit, for the traces

TRANSITIONS = (t_schedule, t_free_only, t_process, t_process_discarded, t_process_failed_load,
               t_preempt, t_finish)


# ==================================================================== results


@dataclass
class StepCheck:
    """One induction step: the invariant is preserved by one transition (or holds
    initially, ``transition == "init"``)."""

    transition: str
    status: str  # proved | cti | unknown | vacuous
    seconds: float
    failed: tuple[str, ...] = ()
    cti: str = ""


@dataclass
class ProofResult:
    kind: str
    policy: str
    status: str  # proved | refuted | unknown
    seconds: float
    covers: str
    trace: Trace | None
    detail: str
    prop: int | None = None  # the property a refutation's trace violates
    checks: list[StepCheck] = field(default_factory=list)


@dataclass
class BoundExample:
    label: str
    kind: str
    block_size: int
    param: int
    budget: int
    depth: int
    max_model_len: int
    pre_fix: int  # live_bound(.., tokens_ahead = budget): the sizing before the fix
    post_fix: int  # live_bound(.., tokens_ahead = depth * budget)
    exact: int  # the most a request really holds under settled (reached)

    @property
    def diff(self) -> int:
        return self.post_fix - self.pre_fix


@dataclass
class BoundResult:
    kind: str
    status: str  # proved | unknown | refuted
    seconds: float
    formula: str
    exact_formula: str
    sufficient: str  # the code's formula is never exceeded
    exact_sufficient: str  # nor the exact one
    tight: str  # a run reaches the exact one
    covers: str
    detail: str
    examples: list[BoundExample] = field(default_factory=list)
    checks: list[StepCheck] = field(default_factory=list)


# ============================================================ induction engine


def _instances(s: State, i_, j_):
    """The indices at which the pre-state's quantified conjuncts are instantiated:
    the Skolem indices of the post-state's, shifted by what a transition shifts
    (a process pops index 0), and the ends of the step sequence."""
    zero, one = z3.IntVal(0), z3.IntVal(1)
    idx = [j_, j_ + 1, i_, i_ + 1, zero, one, s.dq, s.q - 1]
    pairs = [(i_, j_), (i_ + 1, j_ + 1), (zero, j_), (zero, j_ + 1), (i_, s.q - 1),
             (i_ + 1, s.q - 1), (s.dq, j_), (zero, one), (s.dq, s.q - 1)]
    return idx, pairs


def _holds(inv: Invariant, s: State, idx, pairs) -> list:
    out = [f(s) for _, f in inv.scalar]
    out += [f(s, j) for _, f in inv.single for j in idx]
    out += [f(s, i, j) for _, f in inv.pair for i, j in pairs]
    return out


def _status(r) -> str:
    return "proved" if r == z3.unsat else "cti" if r == z3.sat else "unknown"


def _describe(m: z3.ModelRef, prm: Params, pre: State | None, post: State,
              choices: dict) -> str:
    def v(t):
        return m.eval(t, model_completion=True)

    pnames = ["B", "W", "D", "S", "M", "P", "N", "E"]
    parts = [f"{n}={v(getattr(prm, n))}" for n in pnames
             if not (n == "W" and not z3_kind(prm.kind).has_param)]
    out = "params " + " ".join(parts)
    keys = ("st", "c", "p", "f", "L", "Kp", "q", "dq", "NF", "NA", "H")
    if pre is not None:
        out += "; before " + " ".join(f"{k}={v(getattr(pre, k))}" for k in keys)
    if choices:
        out += "; choices " + " ".join(f"{k}={v(t)}" for k, t in choices.items())
    out += "; after " + " ".join(f"{k}={v(getattr(post, k))}" for k in keys)
    return out


Hints = Callable[[State, Trans], list]


def check_step(prm: Params, ar: Arith, hyp: Invariant, goal: Invariant,
               builder: Callable, rule: Rule, lemmas=None, hints: Hints | None = None
               ) -> StepCheck:
    """``hyp(s) ∧ transition(s, s') ⇒ goal(s')`` for symbolic parameters.
    ``hints(s, tr)``: lemma instances the proof needs beyond the automatic ones."""
    t0 = time.perf_counter()
    s = fresh_state("pre")
    tr: Trans = builder(s, prm, ar, rule, "t")
    i_, j_ = z3.Ints("i! j!")
    idx, pairs = _instances(s, i_, j_)
    hyps = prm.constraints(ar) + ar.side_conditions() + _holds(hyp, s, idx, pairs)
    hyps += [tr.guard, *(hints(s, tr) if hints else [])]
    conc = goal.conjuncts_at(tr.post, i_, j_)
    bad = z3.Or([z3.Not(c) for _, c in conc])
    insts = ar.instances(hyps + [bad], lemmas)
    sol = z3.Solver()
    sol.set(timeout=STEP_TIMEOUT_MS)
    sol.add(*hyps, *insts, bad)
    r = sol.check()
    st = _status(r)
    if r == z3.unsat:
        # not vacuous: the transition can fire from a state of the invariant
        alive = z3.Solver()
        alive.set(timeout=STEP_TIMEOUT_MS)
        alive.add(*hyps, *insts)
        if alive.check() == z3.unsat:
            return StepCheck(tr.name, "vacuous", time.perf_counter() - t0,
                             cti="the transition cannot fire from an invariant state")
    failed: tuple[str, ...] = ()
    cti = ""
    if r == z3.sat:
        m = sol.model()
        failed = tuple(n for n, c in conc if z3.is_false(m.eval(c, model_completion=True)))
        cti = _describe(m, prm, s, tr.post, tr.choices)
    return StepCheck(tr.name, st, time.perf_counter() - t0, failed, cti)


def check_init(prm: Params, ar: Arith, goal: Invariant, lemmas=None) -> StepCheck:
    t0 = time.perf_counter()
    s = init_state()
    i_, j_ = z3.Ints("i! j!")
    conc = goal.conjuncts_at(s, i_, j_)
    bad = z3.Or([z3.Not(c) for _, c in conc])
    hyps = prm.constraints(ar) + ar.side_conditions()
    sol = z3.Solver()
    sol.set(timeout=STEP_TIMEOUT_MS)
    sol.add(*hyps, *ar.instances(hyps + [bad], lemmas), bad)
    r = sol.check()
    failed: tuple[str, ...] = ()
    if r == z3.sat:
        m = sol.model()
        failed = tuple(n for n, c in conc if z3.is_false(m.eval(c, model_completion=True)))
    return StepCheck("init", _status(r), time.perf_counter() - t0, failed)


def check_inductive(prm: Params, ar: Arith, goal: Invariant, rule: Rule,
                    hyp: Invariant | None = None, lemmas=None,
                    hints: Hints | None = None) -> list[StepCheck]:
    """Init and every transition; ``hyp`` (default ``goal``) may add conjuncts
    already proved invariant; ``lemmas``: the names of the lemmas to instantiate."""
    hyp = goal if hyp is None else hyp
    out = [check_init(prm, ar, goal, lemmas)]
    for b in TRANSITIONS:
        out.append(check_step(prm, ar, hyp, goal, b, rule, lemmas, hints))
    return out


def _lemma_names(kind: str, bound: str | None = None) -> list[str]:
    """The lemmas a proof instantiates: the safety proof's, or those of the bound
    proof for the ``code`` or the ``exact`` formula (None: safety)."""
    names = ["zero", "floor-bounds", "floor-mono", "ceil-bounds", "ceil-mono"]
    chunked = z3_kind(kind).chunked
    if chunked:
        names += ["chunk-bounds", "chunk-mono"]
    if bound is not None:
        names += ["ceil-is-multiple", "mul-step", "mul-mono", _BOUND_HINT[_hint_key(kind, bound)]]
        if chunked:
            names.append("chunk-block-aligned")
    return names


_BOUND_HINT = {"code": "ceil-minus-floor", "exact": "ceil-minus-floor-tight",
               "exact-aligned": "ceil-shift"}


def _hint_key(kind: str, formula: str) -> str:
    return "exact-aligned" if (formula == "exact" and z3_kind(kind).chunked) else formula


def _bound_hints(kind: str, formula: str, prm: Params, ar: Arith) -> Hints:
    """At a schedule the live blocks are ``cb(H') - fb(skipped(y))`` at most, ``y``
    the freeing basis, the loading request's ``p + L`` or the admission start:
    the span lemma at those three."""
    name = _BOUND_HINT[_hint_key(kind, formula)]

    def hints(s: State, tr: Trans) -> list:
        if tr.name != "schedule":
            return []
        cnt = tr.notes["basis_counts"]
        ys = [zmax(0, cnt.computed - cnt.in_flight - cnt.loading), s.p + s.L, tr.notes["a"]]
        return [hint(name, ar, tr.post.H, skipped(kind, y, prm.W, ar)) for y in ys]

    return hints


def covers_text(kind: str, lemmas: list[str]) -> str:
    return (
        f"{kind}: all B>=1, {z3_kind(kind).params_text}, depth D>=1 (any, unbounded), spec S>=0, "
        "budget M>S (chunks of 1..M tokens, 0..min(S,n-1) drafts each), prompt P>=1, "
        "max_new N>=1, max_model_len>=P+N, external tokens 0<=E<P, prefix-cache hits "
        "(multiples of B); every interleaving of schedule / free without schedule / process "
        "(any number of drafts accepted) / failed load / preempt / finish of one request, "
        "other requests only through the budget and preemption; lemmas (each proved for all "
        "integers): "
        + ", ".join(lemmas)
    )


# ================================================================== searching


@dataclass
class _Event:
    kind: str  # "S" schedule | "P" process
    pre: State
    tr: Trans
    inflight: int  # steps in flight before the event


def _skeletons(max_len: int, prop: int):
    """Event sequences after AddRequest, shortest first: a run of schedules and
    processes that never has more than MAX_DEPTH steps in flight."""
    for n in range(1, max_len + 1):
        found = []
        for seq in itertools.product("SP", repeat=n):
            inflight, depth, ok = 0, 0, True
            for e in seq:
                inflight += 1 if e == "S" else -1
                if inflight < 0:
                    ok = False
                    break
                depth = max(depth, inflight)
            if not ok or depth > MAX_DEPTH or seq[0] != "S":
                continue
            if prop == 1 and seq[-1] != "S":
                continue
            if prop == 2 and (seq[-1] != "P" or seq.count("S") < 2):
                continue
            found.append(("".join(seq), depth))
        yield from sorted(found, key=lambda x: x[1])  # shallower first


def _search_params(prm: Params, ar: Arith, depth: int, prop: int) -> list:
    out = [prm.E == 0, depth == prm.D, prm.B >= 2, prm.B <= 8, prm.P <= 64, prm.N <= 64,
           prm.M <= 32, prm.maxlen == prm.T]
    if prop == 2:
        out += [prm.S >= 1, prm.S <= 3]
    else:
        out += [prm.S == 0]
    return out + z3_kind(prm.kind).search_range(prm)


def _unroll(prm: Params, ar: Arith, rule: Rule, skeleton: str):
    """The run of ``skeleton`` from the initial state under the concrete scheduler
    (one request, no prefix cache, no connector)."""
    s = init_state()
    cons: list = []
    events: list[_Event] = []
    inflight = 0
    for i, e in enumerate(skeleton):
        if e == "S":
            tr = t_schedule(s, prm, ar, rule, f"e{i}")
            ch = tr.choices
            prefill = s.c < prm.P
            cons += [tr.guard, ch["h"] == 0,
                     ch["n"] == z3.If(prefill, zmin(prm.M, prm.P - s.c), 1 + prm.S),
                     ch["k"] == z3.If(prefill, 0, prm.S),
                     tr.notes["end"] + prm.S + 2 <= prm.T]
            events.append(_Event("S", s, tr, inflight))
            inflight += 1
        else:
            tr = t_process(s, prm, ar, rule, f"e{i}")
            cons.append(tr.guard)
            events.append(_Event("P", s, tr, inflight))
            inflight -= 1
        s = tr.post
    return cons, events


def _p1_at(ev: _Event, ar: Arith, prm: Params):
    return z3.Or([violation_p1(ev.pre, ev.tr.post, j, ar, prm) for j in range(ev.inflight)]
                 or [z3.BoolVal(False)])


def _p2_at(ev: _Event, ar: Arith, prm: Params):
    return z3.And(ev.tr.notes["rejected"] > 0,
                  z3.Or([violation_p2(ev.tr.post, j, ar, prm) for j in range(ev.inflight - 1)]
                        or [z3.BoolVal(False)]))


@dataclass
class Found:
    trace: Trace | None
    prop: int
    timeline: str
    skeleton: str


def search_counterexample(kind: str, policy: str, rule: Rule, prop: int = 1,
                          max_events: int = MAX_TRACE_EVENTS,
                          deadline: float | None = None) -> Found | None:
    """The shortest run (at most ``max_events`` events, AddRequest included) that
    violates property ``prop`` (2 also requires a property-1 free before it),
    with small parameters."""
    for skeleton, depth in _skeletons(max_events - 1, prop):
        if deadline is not None and time.perf_counter() > deadline:
            return None
        prm = make_params(kind, "_s")
        ar = prm.arith(abstract=False)
        cons, events = _unroll(prm, ar, rule, skeleton)
        if prop == 1:
            goal = _p1_at(events[-1], ar, prm)
        else:
            goal = z3.And(_p2_at(events[-1], ar, prm),
                          z3.Or([_p1_at(ev, ar, prm) for ev in events[:-1] if ev.kind == "S"]))
        sol = z3.Solver()
        sol.set(timeout=SEARCH_TIMEOUT_MS)
        sol.add(*prm.constraints(ar), *_search_params(prm, ar, depth, prop), *cons, goal)
        if sol.check() != z3.sat:
            continue
        m = _minimize(sol, prm)
        return _found(m, kind, policy, prm, ar, events, skeleton, prop)
    return None


def _minimize(sol: z3.Solver, prm: Params) -> z3.ModelRef:
    """Smaller numbers read better: shrink B + W + M + P + N + S (binary search)."""
    m = sol.model()
    size = prm.B + prm.W + prm.M + prm.P + prm.N + prm.S
    sol.set(timeout=2000)
    lo, hi = 0, m.eval(size, model_completion=True).as_long()
    while lo < hi:
        mid = (lo + hi) // 2
        sol.push()
        sol.add(size <= mid)
        r = sol.check()
        if r == z3.sat:
            m = sol.model()
            hi = m.eval(size, model_completion=True).as_long()
        sol.pop()
        if r == z3.unsat:
            lo = mid + 1
        elif r != z3.sat:
            break
    return m


def _found(m: z3.ModelRef, kind: str, policy: str, prm: Params, ar: Arith,
           events: list[_Event], skeleton: str, prop: int) -> Found:
    def v(t) -> int:
        return m.eval(t, model_completion=True).as_long()

    B, W, M, P, N, S, D = (v(x) for x in (prm.B, prm.W, prm.M, prm.P, prm.N, prm.S, prm.D))
    group = Group(kind, W if z3_kind(kind).has_param else 0)
    cfg = None
    if policy in REGISTRY:
        cfg = Config(groups=(group,), block_size=B, num_blocks=max(8, -(-(P + N) // B) + 4),
                     max_num_batched_tokens=M, max_model_len=P + N, spec_tokens=S, depth=D,
                     policy=policy)
        cfg.validate()
    evs: list = [AddRequest("r0", P, N, 0)]
    lines = [f"{group.label()} B={B} budget={M} depth={D} spec={S} policy={policy}",
             f"  #1 AddRequest r0: prompt {P} tokens, max_new {N}"]
    steps: list[tuple[int, int, int, int, int]] = []  # (event no, start, end, k, nfs)
    first_p1: str | None = None
    for no, ev in enumerate(events, start=2):
        tr = ev.tr
        if ev.kind == "S":
            evs.append(Schedule())
            a, end, k = v(tr.notes["a"]), v(tr.notes["end"]), v(tr.choices["k"])
            nf0, nf1 = v(ev.pre.NF), v(tr.post.NF)
            cnt = tr.notes["basis_counts"]
            lo = v(window_lo(kind, a, prm.W, ar))
            step_no = len(steps)
            desc = (f"  #{no} Schedule: step {step_no} computes r0 [{a},{end})"
                    + (f" ({k} drafts)" if k else "")
                    + f", reads blocks {lo // B}..{(end - 1) // B}")
            if nf1 > nf0:
                desc += (f"; frees blocks {nf0 // B}..{nf1 // B - 1} (reason window; counts "
                         f"c={v(cnt.computed)} f={v(cnt.in_flight)} spec={v(cnt.spec)})")
            lines.append(desc)
            for j in range(ev.inflight):
                if z3.is_true(m.eval(violation_p1(ev.pre, tr.post, j, ar, prm),
                                     model_completion=True)):
                    sidx = len(steps) - ev.inflight + j
                    sno, sa, se, _, _ = steps[sidx]
                    jlo = v(window_lo(kind, sa, prm.W, ar))
                    hit = max(nf0 // B, jlo // B)
                    msg = (f"     !! property 1: block {hit} freed while step "
                           f"{sidx} (scheduled at #{sno}, unprocessed, "
                           f"[{sa},{se})) reads blocks {jlo // B}..{(se - 1) // B}")
                    lines.append(msg)
                    first_p1 = first_p1 or msg
                    break
            steps.append((no, a, end, k, nf1))
        else:
            k0 = v(ev.pre.K(0))
            acc = v(tr.choices["acc"])
            r = k0 - acc
            done = len(steps) - ev.inflight
            evs.append(Process({"r0": acc}) if k0 else Process())
            desc = (f"  #{no} Process: step {done} done"
                    + (f", {acc} of {k0} drafts accepted" if k0 else "")
                    + f"; r0 settled at {v(tr.post.p)}")
            if r and ev.inflight > 1:
                desc += f"; later steps shift down by {r}"
            lines.append(desc)
            if r:
                for j in range(ev.inflight - 1):
                    if z3.is_true(m.eval(violation_p2(tr.post, j, ar, prm),
                                         model_completion=True)):
                        sidx = done + 1 + j
                        sno, sa, se, _, nfs = steps[sidx]
                        na = v(tr.post.A(j))
                        jlo = v(window_lo(kind, na, prm.W, ar))
                        lines.append(
                            f"     !! property 2: step {sidx} (scheduled at #{sno} as "
                            f"[{sa},{se})) now computes [{na},{na + se - sa}) and reads block "
                            f"{jlo // B}, NULL in its table (blocks 0..{nfs // B - 1})")
                        break
    title = ("frees a block an unprocessed step still reads (property 1)" if prop == 1 else
             "a rejection makes an unprocessed step read a NULL block (property 2)")
    timeline = f"{policy} on {group.label()}: {title}\n" + "\n".join(lines)
    trace = None
    if cfg is not None:
        trace = Trace(cfg, evs, {"source": "kvcheck prove", "kind": kind, "policy": policy,
                                 "property": prop})
    return Found(trace, prop, timeline, skeleton)


# ========================================================== R-SWA and sink

SINK_NOTE = ("sink's freeing rule is full attention's (nothing is freed before the "
             "request ends), proved with full's model; its reserved blocks are the "
             "pool's, which the fuzzer's content rule checks")
HELD_NOTE = ("{kind} skips nothing (vLLM's get_num_skipped_tokens is 0, as full "
             "attention's): no block leaves before the request ends, so full's model covers "
             "its freeing; what its blocks hold (a ring, the encoder's outputs) is the "
             "fuzzer's to judge")


def _rswa_gap(policy: str) -> tuple[z3.CheckSatResult, dict[str, int], float]:
    """R-SWA's freeing rule (vLLM's ``RSWAManager.remove_skipped_blocks``): on
    basis ``b = policy(counts)`` it frees the blocks wholly inside
    ``[cdiv(P, B) * B, max(P, b - R))``. The lemma: no such block meets the
    window ``[0, P) + [t-R+1, t]`` of any position ``t`` at or past the
    settled count ``s = c - f - loading``, where every unprocessed step
    computes and every rollback returns (the one-request model proves that
    part for every kind). Returns Z3's answer to the negation and, when it
    is ``sat``, the model's values."""
    B, R, P, c, f, L, k, t, lg, first, last = z3.Ints(
        "B R P c f loading spec t lg first last")
    try:
        b = zmax(0, REGISTRY[policy](Group("rswa", 1), Counts(c, f, L, k)))
    except (z3.Z3Exception, TypeError) as e:
        raise PolicyNotSymbolic(
            f"policy {policy!r} cannot be applied to symbolic counts: {e}") from None
    s_ = c - f - L
    m = zmax(P, b - R)
    x0 = lg * B
    sol = z3.Solver()
    sol.set("timeout", STEP_TIMEOUT_MS)
    sol.add(B >= 1, B <= 64, R >= 1, P >= 1, f >= 0, L >= 0, k >= 0, k <= f, s_ >= 0,
            first * B >= P, (first - 1) * B < P, last * B <= m, m < (last + 1) * B,
            first <= lg, lg < last, t >= s_,
            z3.Or(x0 < P, z3.And(x0 + B > t - R + 1, x0 <= t)))
    t0 = time.perf_counter()
    res = sol.check()
    vals: dict[str, int] = {}
    if res == z3.sat:
        mod = sol.model()
        vals = {str(v): mod.eval(v, model_completion=True).as_long()
                for v in (B, R, P, c, f, L, k, t, lg)}
    return res, vals, time.perf_counter() - t0


def rswa_counterexample(policy: str, block_size: int = 4, window: int = 2) -> Trace:
    """A run that shows an R-SWA rule freeing on the wrong count: one request
    with a one-token prompt decoding with two drafts per step at depth 2, so a
    step of three tokens is always ahead of the settled count; three does not
    divide a power-of-two block size, so the gap's edge sweeps every block
    boundary. ``kvcheck prove`` and the tests replay it on the reference
    target under the policy."""
    B, R = block_size, window
    n = 3 * B + 3 * R + 6
    cfg = Config(groups=(Group("rswa", R),), block_size=B, num_blocks=4 + -(-(n + 4) // B),
                 max_num_batched_tokens=2 * B, max_model_len=n + 4, spec_tokens=2, depth=2,
                 policy=policy)
    cfg.validate()
    evs: list = [AddRequest("r0", 1, n), Schedule(), Schedule()]
    for _ in range(n // 3 - 2):
        evs += [Process(), Schedule()]
    evs += [Process(), Process()]
    return Trace(cfg, evs, {"source": "kvcheck prove", "kind": "rswa", "policy": policy,
                            "property": 1})


def _prove_rswa(policy: str) -> ProofResult:
    t0 = time.perf_counter()
    covers = ("rswa: all B in 1..64, R>=1, P>=1, counts c, f, loading, drafts>=0 with "
              "c-f-loading>=0, every position t at or past the settled count; the gap "
              "lemma on vLLM's rule, over the one-request model's invariant that no "
              "unprocessed step computes below the settled count")
    try:
        res, vals, secs = _rswa_gap(policy)
    except PolicyNotSymbolic as e:
        return ProofResult("rswa", policy, "unknown", time.perf_counter() - t0, covers, None,
                           str(e))
    check = StepCheck("gap lemma", "proved" if res == z3.unsat else
                      "cti" if res == z3.sat else "unknown", secs)
    if res == z3.unsat:
        return ProofResult("rswa", policy, "proved", time.perf_counter() - t0, covers, None,
                           f"gap lemma {secs:.2f}s", checks=[check])
    if res == z3.sat:
        v = vals
        story = (f"{policy} on rswa: frees a block an unprocessed step still reads "
                 f"(property 1)\n  gap lemma fails: B={v['B']} R={v['R']} P={v['P']}, "
                 f"c={v['c']} f={v['f']}: block {v['lg']} freed while position {v['t']} "
                 f"(>= settled {v['c'] - v['f'] - v['loading']}) reads it")
        return ProofResult("rswa", policy, "refuted", time.perf_counter() - t0, covers,
                           rswa_counterexample(policy), story, prop=1, checks=[check])
    return ProofResult("rswa", policy, "unknown", time.perf_counter() - t0, covers, None,
                       f"Z3 answered {res} on the gap lemma", checks=[check])


# ========================================================= retained tokens

RETAINED_NOTE = ("retained tokens: sliding(W, R) (vLLM's extra_retained_tokens R >= 0) frees "
                 "as sliding(W+R) and every step of it, a prefill chunk computing up to R "
                 "positions below its start again included, reads inside sliding(W+R)'s "
                 "windows, so the proof for every window covers it; the rule that forgets R "
                 "is refuted")


def retained_checks() -> list[StepCheck]:
    """sliding(W, R) reduced to sliding(W+R) (the proof holds for every
    window): vLLM's skipped count ``max(0, n - W + 1 - R)`` equals the
    model's for window ``W + R``, and a step continuing the prefill from ``a``
    with ``l <= R`` positions computed again reads from ``lo_W(a - l)``, never
    below ``lo_{W+R}(a)``. And the slip: freeing on ``n - W + 1`` frees a
    block such a step reads (sat, with its values)."""
    n, a, lead, W, R, B, q = z3.Ints("n a lead W R B q")
    ar = Arith(B, z3.Int("C"), z3.Int("M"))
    hyps = [W >= 1, R >= 0]
    out = [_valid("retained: vLLM's rule is sliding(W+R)'s", hyps + [n >= 0],
                  z3.If(n <= 0, 0, zmax(0, n - W + 1 - R)) == skipped("sliding", n, W + R, ar),
                  ar),
           _valid("retained: a re-prefilling step reads inside sliding(W+R)",
                  hyps + [a >= 0, lead >= 0, lead <= R, lead <= a],
                  zmax(0, a - lead - W + 1) >= window_lo("sliding", a, W + R, ar), ar)]
    # the slip: the settled count n, a block [q*B, (q+1)*B) freed by the rule
    # that forgets R, and the next chunk (from n, R positions again) reading it
    t0 = time.perf_counter()
    sol = z3.Solver()
    sol.set(timeout=STEP_TIMEOUT_MS)
    sol.add(W >= 1, R >= 1, B >= 1, B <= 64, n >= R, q >= 0, (q + 1) * B <= n - W + 1,
            zmax(0, n - R - W + 1) < (q + 1) * B)
    r = sol.check()
    cti = ""
    if r == z3.sat:
        m = sol.model()
        cti = ", ".join(f"{v}={m.eval(v, model_completion=True)}" for v in (B, W, R, n, q))
    out.append(StepCheck("retained: the rule forgetting R frees a block a chunk reads",
                         "proved" if r == z3.sat else _status(r), time.perf_counter() - t0,
                         cti=cti))
    return out


# ===================================================================== proving

DEFAULT_PROP2 = {("mamba-local", "sliding")}  # refute with a rejection (spec tokens)
# kinds without a one-request Z3 model: proved by a lemma of their own, or through
# the model of a kind whose freeing rule they share (with a note why that holds)
OWN_PROOFS: dict[str, Callable[[str], ProofResult]] = {"rswa": _prove_rswa}
PROVED_AS: dict[str, tuple[str, str]] = {
    "sink": ("full", SINK_NOTE), "ring": ("full", HELD_NOTE.format(kind="ring")),
    "cross": ("full", HELD_NOTE.format(kind="cross"))}
PROVED_KINDS = (*Z3_KINDS, *OWN_PROOFS, *PROVED_AS)


def prove(kind: str, policy: str, rule: Rule | None = None, search: bool = True,
          prop: int | None = None) -> ProofResult:
    """Prove the freeing invariant for ``kind`` under ``policy`` (or a custom
    ``rule``), or refute it with a trace."""
    if kind in OWN_PROOFS and rule is None:
        return OWN_PROOFS[kind](policy)
    if kind in PROVED_AS:
        via, note = PROVED_AS[kind]
        r = prove(via, policy, rule, search, prop)
        return replace(r, kind=kind, covers=f"{note}; {via}'s proof covers: {r.covers}")
    t0 = time.perf_counter()
    custom = rule is not None
    lemmas = _lemma_names(kind)
    covers = covers_text(kind, lemmas)
    bad_lemmas = [r.name for r in prove_lemmas() if r.status != "proved" and r.name in lemmas]
    try:
        rule = rule or policy_rule(policy)
        prm = make_params(kind)
        ar = prm.arith(abstract=True)
        inv = safety_invariant(prm, ar)
        checks = check_inductive(prm, ar, inv, rule, lemmas=lemmas)
    except PolicyNotSymbolic as e:
        return ProofResult(kind, policy, "unknown", time.perf_counter() - t0, covers, None,
                           str(e))
    if KIND_CLASSES[kind].retains_tokens and not custom:
        checks = [*checks, *retained_checks()]
        covers = f"{RETAINED_NOTE}; {covers}"
    steps = "; ".join(f"{c.transition} {c.seconds:.2f}s" for c in checks)
    if all(c.status == "proved" for c in checks) and not bad_lemmas:
        return ProofResult(kind, policy, "proved", time.perf_counter() - t0, covers, None,
                           f"inductive: {steps}", checks=checks)
    broken = [c for c in checks if c.status != "proved"]
    cti = "; ".join(
        f"{c.transition}: {c.status}"
        + (f" (breaks {', '.join(c.failed)})" if c.failed else "")
        + (f" [{c.cti}]" if c.cti else "")
        for c in broken)
    if bad_lemmas:
        cti += f"; lemmas not proved: {', '.join(bad_lemmas)}"
    if search and not bad_lemmas and any(c.status == "cti" for c in broken):
        want = prop or (2 if (policy, kind) in DEFAULT_PROP2 else 1)
        found = search_counterexample(kind, policy, rule, want)
        if found is None and want == 2:
            found = search_counterexample(kind, policy, rule, 1)
        if found is not None:
            return ProofResult(kind, policy, "refuted", time.perf_counter() - t0, covers,
                               found.trace, found.timeline + "\n  counterexample to induction: "
                               + cti, prop=found.prop, checks=checks)
    return ProofResult(kind, policy, "unknown", time.perf_counter() - t0, covers, None,
                       "not inductive, and no run of at most "
                       f"{MAX_TRACE_EVENTS} events violates it: {cti}", checks=checks)


def _default_policies() -> list[str]:
    names = list(REGISTRY)
    return (["settled"] if "settled" in names else []) + [n for n in names if n != "settled"]


def prove_all(kinds=None, policies=None) -> list[ProofResult]:
    """Every kind under every policy (default: all kinds, all registered policies)."""
    kinds = list(kinds or PROVED_KINDS)
    policies = list(policies or _default_policies())
    for k in kinds:
        if k not in PROVED_KINDS:
            raise ValueError(f"unknown kind {k!r} (known: {', '.join(PROVED_KINDS)})")
    for p in policies:
        if p not in REGISTRY:
            raise ValueError(f"unknown policy {p!r} (known: {', '.join(REGISTRY)})")
    return [prove(k, p) for p in policies for k in kinds]


# ============================================================ admission bound

EXAMPLES: tuple[tuple[str, str, int, int, int, int, int], ...] = (
    # label, kind, B, param, budget M, depth D, max_model_len
    ("kvcheck default", "sliding", 16, 16, 64, 2, 512),
    ("Gemma-style SWA 4k, async", "sliding", 16, 4096, 8192, 2, 131072),
    ("SWA 1k, PP depth 4", "sliding", 16, 1024, 2048, 4, 32768),
    ("SWA 128, small batch", "sliding", 16, 128, 256, 2, 8192),
    ("Llama-4-style chunk 8k, async", "chunked_local", 16, 8192, 8192, 2, 131072),
    ("chunk 256, PP depth 3", "chunked_local", 16, 256, 512, 3, 16384),
    ("mamba state, async", "mamba", 16, 0, 2048, 2, 32768),
    ("mamba state, PP depth 4", "mamba", 16, 0, 512, 4, 8192),
    ("full attention", "full", 16, 0, 2048, 2, 4096),
)


def bound_examples(kind: str | None = None) -> list[BoundExample]:
    out = []
    for label, k, B, param, M, D, L in EXAMPLES:
        if kind is not None and k != kind:
            continue
        g = Group(k, param)
        out.append(BoundExample(label, k, B, param, M, D, L,
                                code_live_bound(g, B, L, M), code_live_bound(g, B, L, D * M),
                                exact_bound(k, B, L, D * M, param)))
    return out




def _quiet(s: State, prm: Params, ar: Arith, p) -> z3.BoolRef:
    """Q(p): running, nothing in flight, ``p`` settled, freed up to ``skipped(p-1)``."""
    sk = skipped(prm.kind, p - 1, prm.W, ar)
    return z3.And(s.st == RUN, s.started, s.q == 0, s.dq == 0, s.c == p, s.p == p, s.f == 0,
                  s.L == 0, s.Kp == 0, p == s.H, ar.cb(p) == s.NA, ar.fb(sk) == s.NF)


def _batched(s: State, prm: Params, ar: Arith, sw, j) -> z3.BoolRef:
    """F(j): ``j`` full batches in flight from settled count ``sw``."""
    c = sw + ar.mul(j)
    return z3.And(s.st == RUN, s.started, s.q == j, s.dq == 0, s.p == sw, s.L == 0,
                  s.Kp == 0, s.c == c, s.f == ar.mul(j), c == s.H, ar.cb(c) == s.NA,
                  ar.fb(skipped(prm.kind, sw, prm.W, ar)) == s.NF)


def _valid(name: str, hyps: list, claim, ar: Arith, lemmas=None) -> StepCheck:
    t0 = time.perf_counter()
    sol = z3.Solver()
    sol.set(timeout=STEP_TIMEOUT_MS)
    bad = z3.Not(claim)
    sol.add(*hyps, *ar.instances(hyps + [bad], lemmas), bad)
    r = sol.check()
    return StepCheck(name, _status(r), time.perf_counter() - t0)


def _valid_nonlinear(name: str, hyps: list, claim) -> StepCheck:
    t0 = time.perf_counter()
    r = check_nonlinear([*hyps, z3.Not(claim)], STEP_TIMEOUT_MS // 2)
    return StepCheck(name, _status(r), time.perf_counter() - t0)


def _fixed(tr: Trans, **vals) -> list:
    return [tr.choices[k] == v for k, v in vals.items()]


def _reachability(kind: str) -> list[StepCheck]:
    """A run reaches the exact bound, for all parameters (with ``E = 0``):
    Q(1) from the initial state; Q(p) -> Q(p+1) (schedule one token, process it);
    Q(sw) -> F(1) -> ... -> F(D) (schedule full batches); and F(D) holds exactly
    the exact bound. Each arrow is checked for symbolic parameters and counts."""
    prm = make_params(kind)
    ar = prm.arith(abstract=True)
    rule = policy_rule("settled")
    base = prm.constraints(ar) + ar.side_conditions() + [prm.E == 0]
    out = []
    # Q(1) from init
    s0 = init_state()
    t1 = t_schedule(s0, prm, ar, rule, "a")
    t2 = t_process(t1.post, prm, ar, rule, "b")
    hyps = base + _fixed(t1, h=0, n=1, k=0) + _fixed(t2, acc=0)
    out.append(_valid("reach Q(1)", hyps, z3.And(t1.guard, t2.guard,
                                                 _quiet(t2.post, prm, ar, 1)), ar))
    # Q(p) -> Q(p+1)
    p = z3.Int("p!")
    s = fresh_state("q")
    t1 = t_schedule(s, prm, ar, rule, "a")
    t2 = t_process(t1.post, prm, ar, rule, "b")
    hyps = base + [_quiet(s, prm, ar, p), p >= 1, p + 1 <= prm.T, p + 1 <= prm.maxlen - 1]
    hyps += _fixed(t1, h=0, n=1, k=0) + _fixed(t2, acc=0)
    out.append(_valid("reach Q(p) -> Q(p+1)", hyps, z3.And(
        t1.guard, t2.guard, _quiet(t2.post, prm, ar, p + 1)), ar))
    sw = z3_kind(kind).witness_start(prm)
    if sw is None:  # full: the whole table
        # Q(L-2) -> schedule position L-2: the table covers the last position L-1
        s = fresh_state("f")
        t1 = t_schedule(s, prm, ar, rule, "a")
        hyps = base + [_quiet(s, prm, ar, prm.maxlen - 2), prm.maxlen == prm.T,
                       prm.maxlen >= 3] + _fixed(t1, h=0, n=1, k=0)
        out.append(_valid("reach full table", hyps, z3.And(
            t1.guard, ar.cb(prm.maxlen - 1) == t1.post.NA - t1.post.NF), ar))
        return out
    room = [sw + ar.mul(prm.D) <= prm.P, sw >= 1]
    # Q(sw) -> F(1)
    s = fresh_state("q")
    t1 = t_schedule(s, prm, ar, rule, "a")
    hyps = base + room + [_quiet(s, prm, ar, sw)] + _fixed(t1, h=0, n=prm.M, k=0)
    out.append(_valid("reach F(1)", hyps, z3.And(t1.guard, _batched(t1.post, prm, ar, sw, 1)),
                      ar))
    # F(j) -> F(j+1)
    j = z3.Int("j!")
    s = fresh_state("b")
    t1 = t_schedule(s, prm, ar, rule, "a")
    hyps = base + room + [_batched(s, prm, ar, sw, j), j >= 1, j < prm.D] + _fixed(
        t1, h=0, n=prm.M, k=0)
    out.append(_valid("reach F(j) -> F(j+1)", hyps, z3.And(
        t1.guard, _batched(t1.post, prm, ar, sw, j + 1)), ar))
    # F(D) holds the exact bound: concrete arithmetic, X = D*M
    out.append(_final_equality(kind))
    return out


def _final_equality(kind: str) -> StepCheck:
    prm = make_params(kind, "_x")
    ar = prm.arith(abstract=False)
    X = z3.Int("X")  # D*M
    sw = z3_kind(kind).witness_start(prm)
    live = ar.cb(sw + X) - ar.fb(skipped(kind, sw, prm.W, ar))
    m = z3_kind(kind)
    sp = m.span(X, prm.W)
    exact = ar.cb(sp) if m.chunked else ar.cb(sp - 1) + prm.B
    hyps = [prm.B >= 1, X >= 0] + ([prm.W >= 1] if m.has_param and not m.chunked else [])
    name = "F(D) holds the exact bound"
    if m.chunked:
        k = z3.Int("k")
        hyps += [k >= 1, k * prm.B == prm.W]
        # in three easy steps: fc(2C-1) = C, fb(C) = C, cb(2C-1+X) - C = cb(C-1+X)
        steps = [ar.fc(sw) == prm.W, ar.fb(prm.W) == prm.W,
                 ar.cb(sw + X) - prm.W == ar.cb(prm.W - 1 + X)]
        t0 = time.perf_counter()
        for i, claim in enumerate(steps):
            c = _valid_nonlinear(name, hyps + steps[:i], claim)
            if c.status != "proved":
                return StepCheck(name, c.status, time.perf_counter() - t0)
        c = _valid_nonlinear(name, hyps + steps, live == exact)
        return StepCheck(name, c.status, time.perf_counter() - t0)
    return _valid_nonlinear(name, hyps, live == exact)


def _code_vs_exact(kind: str) -> StepCheck:
    """How the code's reservation compares with the exact maximum (uncapped terms)."""
    B, W, X = z3.Ints("B W X")
    ar = Arith(B)
    m = z3_kind(kind)
    sp = m.span(X, W)
    if sp is None:  # full: code cdiv(L, B), exact cdiv(L - 1, B): W stands for L
        claim = ar.cb(W) - ar.cb(W - 1) == z3.If((W - 1) % B == 0, B, 0)
        name = "code = exact + (1 block iff L % B == 1)"
        return _valid_nonlinear(name, [B >= 1, W >= 1], claim)
    code = ar.cb(sp) + B
    if m.chunked:
        claim = code - ar.cb(sp) == B
        name = "code = exact + 1 block"
    else:
        claim = code - (ar.cb(sp - 1) + B) == z3.If((sp - 1) % B == 0, B, 0)
        name = "code = exact + (1 block iff span % B == 1)"
    hyps = [B >= 1, X >= 0, W >= 1]
    return _valid_nonlinear(name, hyps, claim)


def check_bound(kind: str, formula: str = "code", pre_fix: bool = False) -> list[StepCheck]:
    """Induction for the live-block bound under ``settled``: ``formula`` ``code``
    (``windows.live_bound``) or ``exact``, with ``D*M`` tokens ahead, or the
    budget ``M`` alone (``pre_fix``: the sizing before the fix, which fails)."""
    prm = make_params(kind)
    ar = prm.arith(abstract=True)
    rule = policy_rule("settled")
    safety = safety_invariant(prm, ar)
    # the safety invariant is proved inductive by prove(kind, "settled"); here its
    # bookkeeping conjuncts are assumed in the pre-state
    props = ("P1", "P2")
    support = Invariant([x for x in safety.scalar if not x[0].startswith(props)],
                        [x for x in safety.single if not x[0].startswith(props)], safety.pair)
    goal = bound_invariant(prm, ar, formula, ahead=prm.M if pre_fix else None)
    cs = check_inductive(prm, ar, goal, rule, hyp=support.extend(goal),
                         lemmas=_lemma_names(kind, formula),
                         hints=_bound_hints(kind, formula, prm, ar))
    for c in cs:
        c.transition = f"{formula}{' pre-fix' if pre_fix else ''}: {c.transition}"
    return cs


def admission_bound(kind: str) -> BoundResult:
    t0 = time.perf_counter()
    lemmas = sorted(set(_lemma_names(kind, "code") + _lemma_names(kind, "exact")))
    prm = make_params(kind)
    ar = prm.arith(abstract=True)
    safe = check_inductive(prm, ar, safety_invariant(prm, ar), policy_rule("settled"),
                           lemmas=_lemma_names(kind))
    results = {}
    checks = list(safe)
    for formula in ("code", "exact"):
        cs = check_bound(kind, formula)
        checks += cs
        ok = all(c.status == "proved" for c in cs + safe)
        results[formula] = "proved" if ok else (
            "refuted" if any(c.status == "cti" for c in cs) else "unknown")
    reach = _reachability(kind)
    rel = _code_vs_exact(kind)
    checks += reach + [rel]
    tight = "proved" if all(c.status == "proved" for c in reach) else "unknown"
    bad_lemmas = [r.name for r in prove_lemmas() if r.status != "proved" and r.name in lemmas]
    if bad_lemmas:
        results = {k: "unknown" for k in results}
        tight = "unknown"
    status = "proved" if (results["code"] == results["exact"] == tight == "proved") else (
        "refuted" if "refuted" in results.values() else "unknown")
    m = z3_kind(kind)
    code_f, exact_f, wit = m.code_formula, m.exact_formula, m.witness_text
    covers = (
        f"never exceeded (code and exact): {covers_text(kind, lemmas)}; T = D*M tokens "
        "ahead of the settled count (a connector's load adds none: admission NULL-pads "
        "before the window of the first computed position), L = max_model_len, positions "
        "below min(P + N, L - 1). Exact bound reached: for all parameters with E = 0 and "
        + (f"P >= {wit} + D*M (the run settles {wit} tokens one at a time, then "
           "schedules D full batches of M)" if wit else "P + N = L >= 3")
        + "; reachability by induction on the settled count and on the batches in flight")
    rel_txt = m.slack_text
    detail = (f"live blocks <= {code_f} (model/windows.live_bound with tokens_ahead = D*M, "
              f"as the reference sizes its pool): {results['code']}; exact maximum "
              f"{exact_f}: never exceeded {results['exact']}, reached {tight}; {rel_txt} "
              f"({rel.status}). Before the fix the pool was sized with T = M "
              "(live_bound(g, B, L, budget)); under settled a request holds up to the "
              "exact bound with T = D*M, more than that for D >= 2.")
    return BoundResult(kind, status, time.perf_counter() - t0, f"{code_f}, T = D*M",
                       f"{exact_f}, T = D*M", results["code"], results["exact"], tight,
                       covers, detail, bound_examples(kind), checks)


def admission_bounds(kinds=None) -> list[BoundResult]:
    return [admission_bound(k) for k in (kinds or Z3_KINDS)]


# ================================================================= formatting


def format_results(results: list[ProofResult | BoundResult], verbose: bool = False) -> str:
    """A table of verdicts, then the counterexamples and bounds, for a terminal."""
    lines: list[str] = []
    proofs = [r for r in results if isinstance(r, ProofResult)]
    bounds = [r for r in results if isinstance(r, BoundResult)]
    if proofs:
        lines.append(f"{'kind':<14} {'policy':<12} {'verdict':<9} {'time':>7}  note")
        for r in proofs:
            if r.status == "refuted":
                n = f"{len(r.trace.events)} events" if r.trace else "no replayable trace"
                note = f"property {r.prop}, {n}"
            elif r.status == "proved":
                slow = max(r.checks, key=lambda c: c.seconds, default=None)
                note = (f"inductive: init + {len(r.checks) - 1} transitions"
                        + (f" (slowest {slow.transition} {slow.seconds:.2f}s)" if slow else ""))
            else:
                note = r.detail.splitlines()[0][:60]
            lines.append(f"{r.kind:<14} {r.policy:<12} {r.status:<9} {r.seconds:>6.2f}s  {note}")
        for r in proofs:
            if r.status == "refuted":
                story, _, rest = r.detail.partition("\n  counterexample to induction")
                saved = rest.rpartition("; trace saved: ")[2] if "; trace saved: " in rest else ""
                lines += ["", story] + ([f"  trace saved: {saved}"] if saved else [])
            elif r.status == "unknown":
                lines += ["", f"{r.kind} / {r.policy}: {r.detail}"]
            if verbose:
                lines += ["", f"{r.kind} / {r.policy} covers: {r.covers}"]
                lines += [f"    {c.transition:<22} {c.status:<8} {c.seconds:.2f}s"
                          + (f"  breaks {', '.join(c.failed)}" if c.failed else "")
                          for c in r.checks]
    if verbose:
        lines += ["", "lemmas (for all integers x, y and B, C >= 1, M >= 0; nonlinear, "
                      "proved once and instantiated in the proofs):"]
        lines += [f"    {r.name:<24} {r.status:<8} {r.seconds:.3f}s  {r.text}"
                  for r in prove_lemmas()]
    if bounds:
        if lines:
            lines.append("")
        lines.append("admission bound (live blocks per request, settled)")
        for b in bounds:
            lines.append(f"  {b.kind:<14} {b.status:<8} {b.seconds:>6.2f}s  code: {b.formula}")
            lines.append(f"  {'':<14} {'':<8} {'':>7}  exact: {b.exact_formula}"
                         f"  (sufficient {b.exact_sufficient}, reached {b.tight})")
            for e in b.examples:
                lines.append(
                    f"      {e.label:<32} B={e.block_size} param={e.param} M={e.budget} "
                    f"D={e.depth} L={e.max_model_len}: pre-fix {e.pre_fix}, post-fix "
                    f"{e.post_fix} (+{e.diff}), exact {e.exact}")
            if verbose:
                lines.append(f"      {b.detail}")
                lines.append(f"      covers: {b.covers}")
    return "\n".join(lines)


def format_bounds(bounds: list[BoundResult], verbose: bool = False) -> str:
    """The admission-bound part of :func:`format_results`."""
    return format_results(list(bounds), verbose=verbose)


__all__ = [
    "BoundExample", "BoundResult", "ProofResult", "StepCheck", "admission_bound",
    "admission_bounds", "bound_examples", "check_bound", "check_inductive", "format_bounds",
    "format_results",
    "prove", "prove_all", "search_counterexample",
]
