"""The freeing model of one request, in Z3.

Three layers, each mirrored from the executable model:

1. **Terms** (:func:`window_lo`, :func:`skipped`, :func:`freeable_tokens`,
   :func:`live_bound`, ...): ``model/windows.py`` written over Z3 integers, for
   symbolic ``B``, ``W``, ``C``. ``eval_*`` evaluate them on numbers (the
   correspondence tests compare them with ``windows.py`` and with vLLM's own
   ``get_num_skipped_tokens``).

2. **State and transitions** of one request (docs/DESIGN.md's events as seen by
   one request). Positions are tokens; a block boundary is kept in tokens too
   (``NF`` = null-prefix blocks times ``B``), so the rules stay linear::

       table      [ NULL | NULL | b7 | b3 | b9 | b2 ]
                  0      B     NF=2B           NA=6B
       (``FR <= NF``: the end of the blocks freed for the window; the rest of
        the NULL prefix was padded at admission and never allocated)
       steps in flight (oldest first), contiguous from the settled count p:
                  p+L         A(1)        A(2)          c
                  |-- step 0 --|-- step 1 --|-- step 2 --|
                  (step 0 may be the connector's loading step: it loads
                   [p, p+L) and computes from p+L)

   The in-flight steps are a sequence of any length ``q <= D`` (symbolic
   depth), held as uninterpreted functions of the index: ``A(j)`` start,
   ``N(j)`` tokens, ``K(j)`` drafts, ``WS(j)`` the lowest start step ``j``
   can have after every earlier step rejects all its drafts, ``TAB(j)``
   whether it reads the current block table (a preemption replaces the
   table), ``AS(j)``/``NFS(j)`` its start and null prefix when scheduled.
   Steps ``[0, dq)`` are discarded (preempted or failed-load outputs) but
   still run on the device.

   Transitions: ``schedule`` (admission with a prefix-cache hit ``h`` and,
   the first time, a connector load ``[h, E)``, the table NULL-padded before
   the window of the first computed position; or a running step), whose new
   interval has ``1 <= n <= M`` tokens (``M`` the symbolic batch budget, other
   requests taking the rest), ``0 <= k <= min(S, n-1)`` drafts; before
   allocating, a running request frees by the rule ``rule(counts)`` leading
   tokens' blocks (capped at the table), ``counts = (c, f, loading, drafts in
   flight)`` as in ``model.policy``; ``free-only`` (the free happens, the
   allocation does not fit); ``process`` (the oldest step: any number of its
   drafts accepted; later steps shift down by the rejected count); ``process``
   of a discarded step; ``process`` of a loading step whose load failed at
   block ``k`` (recompute from ``k*B`` or, as the reference does, from the
   highest block start before it whose window is still held); ``preempt``;
   ``finish``.

3. **Invariants** (:func:`safety_invariant`, :func:`bound_invariant`) in the
   Ivy style: scalar conjuncts, conjuncts for all ``j`` and for all ``i < j``.
   :mod:`prove.proof` checks them one transition at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import z3

from model.events import Group
from model.policy import REGISTRY, Counts

from .z3_arith import Arith, zmax, zmin

WAIT, RUN, DONE = 0, 1, 2

# ===================================================================== terms


class Z3Kind:
    """The Z3 mirror of one kind of :mod:`model.kinds`: its terms over symbolic
    ``B`` and window/chunk ``W`` (``ar.C`` for a chunk), and the facts its proofs
    need. A kind with a one-request Z3 model has one subclass here."""

    name: ClassVar[str]
    has_param: ClassVar[bool] = False  # W >= 1 (else W == 0)
    chunked: ClassVar[bool] = False  # W is a chunk: ar.C = W, C % B == 0, chunk lemmas
    params_text: ClassVar[str] = "no window parameter"
    # the live-block bound, as the code reserves it and exactly (T = D*M, L =
    # max_model_len), the witness's settled count, and how far apart the two are
    code_formula: ClassVar[str]
    exact_formula: ClassVar[str]
    witness_text: ClassVar[str | None] = None
    slack_text: ClassVar[str]

    def lo(self, t, W, ar: Arith):
        """Lowest position read when computing position ``t >= 0``."""
        raise NotImplementedError

    def span(self, ahead, W):
        """Tokens ``live_bound`` keeps when freeing ``ahead`` tokens behind
        (None: the whole request)."""
        return None

    def exact_tokens(self, full, sp, ar: Arith):
        """The exact live bound in tokens for span ``sp``, capped by ``full``."""
        return zmin(full, ar.cb(sp - 1) + ar.B)

    def witness_start(self, prm: Params):
        """The settled count from which ``D`` full batches reach the exact bound
        (None: the whole table is the witness)."""
        return None

    def search_range(self, prm: Params) -> list:
        """The parameter range the bounded counterexample search draws from."""
        return []


class Z3Full(Z3Kind):
    name = "full"
    code_formula, exact_formula = "cdiv(L, B)", "cdiv(L - 1, B)"
    slack_text = ("the code reserves one block more than ever needed iff L % B == 1 (the last "
                  "position, L - 1, is never computed)")

    def lo(self, t, W, ar):
        return z3.IntVal(0)


class Z3Sliding(Z3Kind):
    name = "sliding"
    has_param = True
    params_text = "window W>=1"
    code_formula = "min(cdiv(L, B), cdiv(W - 1 + T, B) + 1)"
    exact_formula = "min(cdiv(L - 1, B), cdiv(W - 2 + T, B) + 1)"
    witness_text = "W + 2B - 2"
    slack_text = "the code reserves one block more than ever needed iff (W - 1 + T) % B == 1"

    def lo(self, t, W, ar):
        return zmax(0, t - W + 1)

    def span(self, ahead, W):
        return W - 1 + ahead

    def witness_start(self, prm):
        return prm.W + 2 * prm.B - 2

    def search_range(self, prm):
        return [prm.W >= 2, prm.W <= 32]


class Z3ChunkedLocal(Z3Kind):
    name = "chunked_local"
    has_param = True
    chunked = True
    params_text = "chunk C>=1 with C%B==0"
    code_formula = "min(cdiv(L, B), cdiv(C - 1 + T, B) + 1)"
    exact_formula = "min(cdiv(L - 1, B), cdiv(C - 1 + T, B))"
    witness_text = "2C - 1"
    slack_text = ("the code always reserves one block more than needed (chunks are "
                  "block-aligned, the +1 is never used) unless capped by L")

    def lo(self, t, W, ar):
        return ar.fc(t)

    def span(self, ahead, W):
        return W - 1 + ahead

    def exact_tokens(self, full, sp, ar):
        return zmin(full, ar.cb(sp))  # a chunk-aligned span: cdiv(span, B) blocks

    def witness_start(self, prm):
        return 2 * prm.W - 1

    def search_range(self, prm):
        return [prm.W >= prm.B, prm.W <= 4 * prm.B]


class Z3Mamba(Z3Kind):
    name = "mamba"
    code_formula = "min(cdiv(L, B), cdiv(1 + T, B) + 1)"
    exact_formula = "min(cdiv(L - 1, B), cdiv(T, B) + 1)"
    witness_text = "2B"
    slack_text = "the code reserves one block more than ever needed iff (1 + T) % B == 1"

    def lo(self, t, W, ar):
        return zmax(0, t - 1)

    def span(self, ahead, W):
        return 1 + ahead

    def witness_start(self, prm):
        return 2 * prm.B


# the kinds with a one-request Z3 model (a head prefix freed); prove/proof.py
# proves sink through full's model and R-SWA's middle gap with its own lemma
Z3_MIRRORS: dict[str, Z3Kind] = {m.name: m for m in (Z3Full(), Z3Sliding(), Z3ChunkedLocal(),
                                                      Z3Mamba())}
Z3_KINDS = tuple(Z3_MIRRORS)


def z3_kind(kind: str) -> Z3Kind:
    m = Z3_MIRRORS.get(kind)
    if m is None:
        raise ValueError(f"kind {kind!r} has no one-request Z3 model (those: "
                         f"{', '.join(Z3_KINDS)})")
    return m


def window_lo(kind: str, t, param, ar: Arith):
    """Lowest position read when computing position ``t >= 0`` (``windows.window(g, t)[0]``).

    For ``chunked_local`` the chunk is ``ar.C`` (``param`` must be the same term)."""
    return z3_kind(kind).lo(t, param, ar)


def skipped(kind: str, n, param, ar: Arith):
    """``windows.skipped(g, n)``: 0 for ``n <= 0``, else ``window_lo(n)``."""
    return z3.If(n <= 0, 0, window_lo(kind, n, param, ar))


def freeable_tokens(kind: str, n, param, ar: Arith):
    """``windows.freeable(g, n, B) * B``: the tokens of the freeable leading blocks."""
    return ar.fb(skipped(kind, n, param, ar))


def freeable(kind: str, n, param, ar: Arith):
    """``windows.freeable(g, n, B)`` in blocks (concrete mode)."""
    return ar.blocks_floor(skipped(kind, n, param, ar))


def live_span(kind: str, ahead, param):
    """Tokens ``live_bound`` keeps when freeing ``ahead`` tokens behind (None for full)."""
    return z3_kind(kind).span(ahead, param)


def live_bound(kind: str, max_model_len, ahead, param, ar: Arith):
    """``windows.live_bound(g, B, max_model_len, ahead)`` in blocks (concrete mode)."""
    full = ar.blocks_ceil(max_model_len)
    sp = live_span(kind, ahead, param)
    if sp is None:
        return full
    return zmin(full, ar.blocks_ceil(sp) + 1)


def live_bound_tokens(kind: str, max_model_len, ahead, param, ar: Arith):
    """``live_bound(...) * B``, in both modes (``cb`` for ``cdiv * B``)."""
    full = ar.cb(max_model_len)
    sp = live_span(kind, ahead, param)
    if sp is None:
        return full
    return zmin(full, ar.cb(sp) + ar.B)


def exact_bound_tokens(kind: str, max_model_len, ahead, param, ar: Arith):
    """The most live tokens' blocks (times ``B``) a request can really hold when the
    manager is ``ahead`` tokens past the count it frees on: the span ``[lo(s), s +
    ahead)`` touches ``cdiv(span - 1, B) + 1`` blocks at most (sliding, mamba), and
    a chunk-aligned span (``C % B == 0``) exactly ``cdiv(span, B)``. Compare
    :func:`live_bound_tokens`, which reserves ``cdiv(span, B) + 1``. Positions
    stop at ``max_model_len - 1``, so a whole request needs
    ``cdiv(max_model_len - 1, B)`` blocks at most."""
    full = ar.cb(max_model_len - 1)
    sp = live_span(kind, ahead, param)
    if sp is None:
        return full
    return z3_kind(kind).exact_tokens(full, sp, ar)


def exact_bound(kind: str, block_size: int, max_model_len: int, tokens_ahead: int,
                param: int = 0) -> int:
    """:func:`exact_bound_tokens` in blocks, on numbers."""
    B = z3.IntVal(block_size)
    ar = Arith(B, C=z3.IntVal(param) if z3_kind(kind).chunked else None)
    r = z3.simplify(exact_bound_tokens(kind, z3.IntVal(max_model_len), z3.IntVal(tokens_ahead),
                                       z3.IntVal(param), ar))
    return r.as_long() // block_size


# ------------------------------------------------- evaluation on numbers


@dataclass
class _Evaluator:
    vars: dict
    terms: dict


_EVALUATORS: dict[str, _Evaluator] = {}


def _evaluator(kind: str) -> _Evaluator:
    ev = _EVALUATORS.get(kind)
    if ev is None:
        t, n, W, B, L, A = z3.Ints("t n W B maxlen ahead")
        ar = Arith(B, C=W)
        terms = {
            "window_lo": window_lo(kind, t, W, ar),
            "skipped": skipped(kind, n, W, ar),
            "freeable": freeable(kind, n, W, ar),
            "freeable_tokens": freeable_tokens(kind, n, W, ar),
            "live_bound": live_bound(kind, L, A, W, ar),
            "live_bound_tokens": live_bound_tokens(kind, L, A, W, ar),
        }
        ev = _Evaluator({"t": t, "n": n, "param": W, "block_size": B, "max_model_len": L,
                         "tokens_ahead": A}, terms)
        _EVALUATORS[kind] = ev
    return ev


def eval_term(name: str, kind: str, **values: int) -> int:
    """Evaluate the Z3 term ``name`` (``window_lo``, ``skipped``, ``freeable``,
    ``freeable_tokens``, ``live_bound``, ``live_bound_tokens``) of ``kind`` on
    numbers, by substitution and simplification. ``values``: ``t``, ``n``,
    ``param`` (W or C), ``block_size``, ``max_model_len``, ``tokens_ahead``."""
    ev = _evaluator(kind)
    term = ev.terms[name]
    subs = [(ev.vars[k], z3.IntVal(v)) for k, v in values.items()]
    r = z3.simplify(z3.substitute(term, *subs))
    if not z3.is_int_value(r):
        raise ValueError(f"{name}({kind}) did not reduce to a number: {r} (missing values?)")
    return r.as_long()


def eval_skipped(kind: str, param: int, n: int) -> int:
    """The Z3 ``skipped`` term on numbers: compare with ``windows.skipped`` and with
    vLLM's ``get_num_skipped_tokens`` (which returns ``n - 1`` for Mamba at ``n = 0``;
    compare ``max(0, ...)`` there)."""
    return eval_term("skipped", kind, n=n, param=param)


def eval_skipped_many(kind: str, param: int, ns) -> list[int]:
    return [eval_skipped(kind, param, n) for n in ns]


def eval_freeable(kind: str, param: int, n: int, block_size: int) -> int:
    return eval_term("freeable", kind, n=n, param=param, block_size=block_size)


def eval_live_bound(kind: str, param: int, block_size: int, max_model_len: int,
                    tokens_ahead: int) -> int:
    return eval_term("live_bound", kind, param=param, block_size=block_size,
                     max_model_len=max_model_len, tokens_ahead=tokens_ahead)


# ================================================================ parameters


@dataclass(frozen=True)
class Params:
    """The symbolic parameters of one proof: block size ``B``, window/chunk ``W``
    (unused for full and mamba), depth ``D``, spec tokens ``S``, budget ``M``,
    prompt ``P``, max new tokens ``N``, ``max_model_len``, external tokens ``E``."""

    kind: str
    B: z3.ArithRef
    W: z3.ArithRef
    D: z3.ArithRef
    S: z3.ArithRef
    M: z3.ArithRef
    P: z3.ArithRef
    N: z3.ArithRef
    maxlen: z3.ArithRef
    E: z3.ArithRef

    @property
    def T(self):
        """Positions a request can ever schedule: ``[0, P + N)``."""
        return self.P + self.N

    @property
    def group(self) -> Group:
        return Group(self.kind, self.W)  # type: ignore[arg-type]

    def constraints(self, ar: Arith) -> list:
        out = [self.B >= 1, self.D >= 1, self.S >= 0, self.M >= self.S + 1, self.P >= 1,
               self.N >= 1, self.maxlen >= self.T, self.E >= 0, self.E < self.P]
        m = z3_kind(self.kind)
        out.append(self.W >= 1 if m.has_param else self.W == 0)
        if m.chunked:
            out.append(ar.is_multiple(self.W))  # Config.validate: C % B == 0
        return out

    def arith(self, abstract: bool, tag: str = "") -> Arith:
        C = self.W if z3_kind(self.kind).chunked else None
        return Arith(self.B, C=C, M=self.M, abstract=abstract, tag=tag)


def make_params(kind: str, tag: str = "") -> Params:
    z3_kind(kind)
    B, W, D, S, M, P, N, L, E = z3.Ints(" ".join(
        f"{x}{tag}" for x in ("B", "W", "D", "S", "M", "P", "N", "maxlen", "E")))
    return Params(kind, B, W, D, S, M, P, N, L, E)


# ===================================================================== state

IntFn = Callable[[z3.ArithRef], z3.ArithRef]
BoolFn = Callable[[z3.ArithRef], z3.BoolRef]


@dataclass(frozen=True)
class State:
    """One request. ``p`` settled, ``c`` optimistic, ``f`` in-flight tokens (vLLM's
    ``num_in_flight_tokens``), ``L`` tokens being loaded, ``Kp`` drafts in flight;
    ``q`` steps in flight of which ``[0, dq)`` are discarded; ``NF``/``NA`` the
    null prefix and the allocated table (tokens, multiples of ``B``); ``FR`` the
    end of the highest block freed for the window in this table (the null prefix
    also holds slots NULL-padded at admission, which were never allocated);
    ``H`` the highest position scheduled into this table."""

    st: z3.ArithRef
    started: z3.BoolRef
    c: z3.ArithRef
    p: z3.ArithRef
    f: z3.ArithRef
    L: z3.ArithRef
    Kp: z3.ArithRef
    q: z3.ArithRef
    dq: z3.ArithRef
    NF: z3.ArithRef
    FR: z3.ArithRef
    NA: z3.ArithRef
    H: z3.ArithRef
    A: IntFn = field(repr=False)
    AS: IntFn = field(repr=False)
    N: IntFn = field(repr=False)
    K: IntFn = field(repr=False)
    WS: IntFn = field(repr=False)
    NFS: IntFn = field(repr=False)
    TAB: BoolFn = field(repr=False)

    def live(self, j) -> z3.BoolRef:
        return z3.And(self.dq <= j, j < self.q)


_SCALARS = ("st", "c", "p", "f", "L", "Kp", "q", "dq", "NF", "FR", "NA", "H")
_ARRAYS = ("A", "AS", "N", "K", "WS", "NFS")


def fresh_state(tag: str) -> State:
    """A state of fresh constants (the pre-state of an induction step)."""
    kw: dict = {n: z3.Int(f"{n}_{tag}") for n in _SCALARS}
    kw["started"] = z3.Bool(f"started_{tag}")
    for n in _ARRAYS:
        kw[n] = z3.Function(f"{n}_{tag}", z3.IntSort(), z3.IntSort())
    kw["TAB"] = z3.Function(f"TAB_{tag}", z3.IntSort(), z3.BoolSort())
    return State(**kw)


def init_state() -> State:
    zero = z3.IntVal(0)
    kw: dict = {n: zero for n in _SCALARS}
    kw["st"] = z3.IntVal(WAIT)
    kw["started"] = z3.BoolVal(False)
    for n in _ARRAYS:
        kw[n] = lambda j: z3.IntVal(0)
    kw["TAB"] = lambda j: z3.BoolVal(False)
    return State(**kw)


def _upd(fn, i, v):
    return lambda j: z3.If(j == i, v, fn(j))


def _shift(fn, delta=None):
    if delta is None:
        return lambda j: fn(j + 1)
    return lambda j: fn(j + 1) + delta


# =============================================================== freeing rules

Rule = Callable[[str, Counts, Params, Arith], z3.ArithRef]


class PolicyNotSymbolic(ValueError):
    """A policy function that cannot be applied to symbolic counts."""


def policy_rule(policy: str) -> Rule:
    """The freeing rule of a registered policy: free ``freeable(g, basis, B)``
    blocks, ``basis = max(0, policy(g, counts))`` (``model.policy.basis``)."""
    fn = REGISTRY[policy]

    def rule(kind: str, counts: Counts, prm: Params, ar: Arith):
        try:
            b = fn(prm.group, counts)
        except (z3.Z3Exception, TypeError) as e:
            raise PolicyNotSymbolic(
                f"policy {policy!r} cannot be applied to symbolic counts: {e}") from None
        return freeable_tokens(kind, zmax(0, b), prm.W, ar)

    rule.__name__ = f"rule_{policy}"
    return rule


# =============================================================== transitions


@dataclass
class Trans:
    name: str
    guard: z3.BoolRef
    post: State
    choices: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)  # terms worth reporting (basis, freed, ...)


def t_schedule(s: State, prm: Params, ar: Arith, rule: Rule, tag: str) -> Trans:
    """Schedule ``n`` new positions ``[a, a+n)`` for the request, ``k`` of them drafts.

    A waiting request is admitted: a prefix-cache hit of ``h`` tokens (a
    multiple of ``B``) and, on its first admission with ``E > h`` external
    tokens, a load of ``[h, E)``; it computes from ``a = max(h, E)``. Its new
    table is NULL up to ``freeable(g, a)`` (NULL-padded, never allocated, as
    vLLM and the reference do), then the hit's blocks; nothing is freed. A
    running request first frees by the rule (never past its table), then
    slots for ``[0, a+n)`` are allocated. Positions stop at
    ``min(P + N, max_model_len - 1)``."""
    n, k, h = z3.Ints(f"n_{tag} k_{tag} h_{tag}")
    admit = s.st == WAIT
    loading = z3.And(admit, z3.Not(s.started), prm.E > 0, h < prm.E)
    ld = z3.If(loading, prm.E - h, 0)
    a = z3.If(admit, h + ld, s.c)
    pad = freeable_tokens(prm.kind, a, prm.W, ar)
    counts = Counts(
        computed=a,
        in_flight=z3.If(admit, 0, s.f),
        loading=z3.If(admit, ld, s.L),
        spec=z3.If(admit, 0, s.Kp),
    )
    p0 = z3.If(admit, h, s.p)
    freed = rule(prm.kind, counts, prm, ar)
    nf_run = zmax(s.NF, zmin(freed, s.NA))
    nf1 = z3.If(admit, pad, nf_run)
    fr1 = z3.If(admit, 0, z3.If(nf_run > s.NF, nf_run, s.FR))
    na0 = z3.If(admit, zmax(pad, h), s.NA)
    h0 = z3.If(admit, a, s.H)
    end = a + n
    guard = z3.And(
        s.st != DONE, s.q < prm.D,
        n >= 1, n <= prm.M, end <= prm.T, end <= prm.maxlen - 1,
        k >= 0, k <= prm.S, k <= n - 1,
        z3.Implies(admit, z3.And(h >= 0, ar.is_multiple(h), ar.cb(h) == h)),
    )
    ws_new = a - counts.spec
    post = State(
        st=z3.IntVal(RUN), started=z3.BoolVal(True),
        c=end, p=p0, f=counts.in_flight + n, L=counts.loading, Kp=counts.spec + k,
        q=s.q + 1, dq=s.dq,
        NF=nf1, FR=fr1, NA=zmax(na0, ar.cb(end)), H=zmax(h0, end),
        A=_upd(s.A, s.q, a), AS=_upd(s.AS, s.q, a), N=_upd(s.N, s.q, n), K=_upd(s.K, s.q, k),
        WS=_upd(s.WS, s.q, ws_new), NFS=_upd(s.NFS, s.q, nf1),
        TAB=_upd(s.TAB, s.q, z3.BoolVal(True)),
    )
    return Trans("schedule", guard, post, {"n": n, "k": k, "h": h},
                 {"a": a, "end": end, "basis_counts": counts, "freed": freed, "nf0": s.NF,
                  "admit": admit, "loading": ld})


def t_free_only(s: State, prm: Params, ar: Arith, rule: Rule, tag: str) -> Trans:
    """A running request's turn in a step frees by the rule, but its new blocks do
    not fit (it is preempted, or waits): the free stays, nothing is scheduled
    (vLLM's ``allocate_slots`` frees before it checks the pool)."""
    counts = Counts(computed=s.c, in_flight=s.f, loading=s.L, spec=s.Kp)
    freed = rule(prm.kind, counts, prm, ar)
    nf = zmax(s.NF, zmin(freed, s.NA))
    post = replace(s, NF=nf, FR=z3.If(nf > s.NF, nf, s.FR))
    return Trans("free-only", s.st == RUN, post, {}, {"basis_counts": counts, "freed": freed})


def t_process(s: State, prm: Params, ar: Arith, rule: Rule, tag: str) -> Trans:
    """The oldest step (live) is processed: ``acc`` of its ``K(0)`` drafts survive;
    the request's later steps shift down by the ``r = K(0) - acc`` rejected."""
    acc = z3.Int(f"acc_{tag}")
    r = s.K(0) - acc
    guard = z3.And(s.q >= 1, s.dq == 0, acc >= 0, acc <= s.K(0))
    post = replace(
        s, p=s.A(0) + s.N(0) - r, c=s.c - r, f=s.f - s.N(0), L=z3.IntVal(0), Kp=s.Kp - s.K(0),
        q=s.q - 1, A=_shift(s.A, -r), AS=_shift(s.AS), N=_shift(s.N), K=_shift(s.K),
        WS=_shift(s.WS, s.K(0) - r), NFS=_shift(s.NFS), TAB=_shift(s.TAB),
    )
    return Trans("process", guard, post, {"acc": acc}, {"rejected": r})


def t_process_discarded(s: State, prm: Params, ar: Arith, rule: Rule, tag: str) -> Trans:
    """The oldest step's output is dropped (its request was preempted, finished
    or failed a load since it was scheduled)."""
    guard = z3.And(s.q >= 1, s.dq >= 1)
    post = replace(
        s, q=s.q - 1, dq=s.dq - 1, A=_shift(s.A), AS=_shift(s.AS), N=_shift(s.N),
        K=_shift(s.K), WS=_shift(s.WS), NFS=_shift(s.NFS), TAB=_shift(s.TAB),
    )
    return Trans("process-discarded", guard, post)


def t_process_failed_load(s: State, prm: Params, ar: Arith, rule: Rule, tag: str) -> Trans:
    """The loading step is processed and its load failed from token ``kf = k*B`` on
    (``p <= kf < p + L``): its output and the later steps' are discarded and the
    request recomputes from ``kr = j*B <= kf``, the highest block start whose
    window it still holds (NULL-padded or freed slots are not held), or from 0
    with an empty table; blocks from ``j`` on are dropped."""
    kf, kr = z3.Ints(f"kf_{tag} kr_{tag}")
    held = z3.And(kr <= s.NA, ar.fb(skipped(prm.kind, kr, prm.W, ar)) >= s.NF)
    guard = z3.And(s.q >= 1, s.dq == 0, s.L > 0, ar.is_multiple(kf), ar.cb(kf) == kf,
                   s.p <= kf, kf < s.p + s.L,
                   ar.is_multiple(kr), ar.cb(kr) == kr, kr >= 0, kr <= kf,
                   z3.Or(kr == 0, held))
    empty = kr == 0
    zero = z3.IntVal(0)
    post = replace(
        s, p=kr, c=kr, f=zero, L=zero, Kp=zero, q=s.q - 1, dq=s.q - 1,
        NF=z3.If(empty, zero, zmin(s.NF, kr)), FR=z3.If(empty, zero, zmin(s.FR, kr)),
        NA=z3.If(empty, zero, zmin(s.NA, kr)), H=kr,
        A=_shift(s.A), AS=_shift(s.AS), N=_shift(s.N), K=_shift(s.K), WS=_shift(s.WS),
        NFS=_shift(s.NFS),
        TAB=lambda j: z3.And(z3.Not(empty), s.TAB(j + 1)),
    )
    return Trans("process-failed-load", guard, post, {"kf": kf, "kr": kr})


def _release(s: State, st: int) -> State:
    zero = z3.IntVal(0)
    return replace(s, st=z3.IntVal(st), c=zero, p=zero, f=zero, L=zero, Kp=zero, dq=s.q,
                   NF=zero, FR=zero, NA=zero, H=zero, TAB=lambda j: z3.BoolVal(False))


def t_preempt(s: State, prm: Params, ar: Arith, rule: Rule, tag: str) -> Trans:
    """All blocks go back; the request waits and recomputes from 0; the outputs of
    its unprocessed steps will be discarded (they read the old table)."""
    return Trans("preempt", s.st == RUN, _release(s, WAIT))


def t_finish(s: State, prm: Params, ar: Arith, rule: Rule, tag: str) -> Trans:
    """Finish or abort: all blocks go back (request-level frees); nothing more is
    freed for the window."""
    return Trans("finish", s.st != DONE, _release(s, DONE))


# ================================================================ invariants


@dataclass
class Invariant:
    """Named conjuncts: scalar ``f(s)``, ``∀j f(s, j)`` and ``∀i,j f(s, i, j)``."""

    scalar: list = field(default_factory=list)
    single: list = field(default_factory=list)
    pair: list = field(default_factory=list)

    def extend(self, other: Invariant) -> Invariant:
        return Invariant(self.scalar + other.scalar, self.single + other.single,
                         self.pair + other.pair)

    def names(self) -> list[str]:
        return [n for n, _ in self.scalar + self.single + self.pair]

    def conjuncts_at(self, s: State, i, j) -> list[tuple[str, z3.BoolRef]]:
        """Each conjunct, the quantified ones at the (Skolem) indices ``i``, ``j``."""
        out = [(n, f(s)) for n, f in self.scalar]
        out += [(n, f(s, j)) for n, f in self.single]
        out += [(n, f(s, i, j)) for n, f in self.pair]
        return out


def safety_invariant(prm: Params, ar: Arith) -> Invariant:
    """"A block is freed only when it is outside every unprocessed step's window
    and no rollback can make it needed again": every block freed for the
    window lies below ``FR <= lo(p)`` (every future position is ``>= p``) and
    ``FR <= lo(WS(j))`` for every step that reads this table (property 1,
    conjuncts ``P1-*``). Also no live step reads a NULL slot of the table it was
    scheduled with, after any rejections, nor does any future step (property 2,
    ``P2-*``: the null prefix, freed or padded, stays below ``lo(p + L)`` and
    ``lo(WS(j))``). The rest is the bookkeeping that makes it inductive."""
    lo = lambda t: window_lo(prm.kind, t, prm.W, ar)  # noqa: E731

    def waiting(s):
        z = [s.c == 0, s.p == 0, s.f == 0, s.L == 0, s.Kp == 0, s.NF == 0, s.FR == 0, s.NA == 0,
             s.H == 0]
        return z3.Implies(s.st != RUN, z3.And(s.dq == s.q, *z))

    def first(s):
        last = s.q - 1
        return z3.Implies(s.dq < s.q, z3.And(
            s.A(s.dq) == s.p + s.L, s.WS(s.dq) == s.A(s.dq), s.c == s.A(last) + s.N(last),
            s.c - s.Kp == s.WS(last) + s.N(last) - s.K(last)))

    scalar = [
        ("ranges", lambda s: z3.And(s.st >= WAIT, s.st <= DONE, s.dq >= 0, s.dq <= s.q,
                                    s.q <= prm.D, s.p >= 0, s.L >= 0)),
        ("not-running-holds-nothing", waiting),
        ("unstarted-is-idle", lambda s: z3.Implies(z3.Not(s.started),
                                                   z3.And(s.st != RUN, s.q == 0))),
        ("settled-count", lambda s: s.c - s.f - s.L == s.p),
        ("idle-counts", lambda s: z3.Implies(s.dq == s.q, z3.And(
            s.f == 0, s.L == 0, s.Kp == 0, s.c == s.p))),
        ("steps-contiguous-from-p", first),
        ("loading-is-first-step", lambda s: z3.Implies(s.L > 0, z3.And(
            s.dq == 0, s.q >= 1, s.p + s.L <= prm.E))),
        ("null-prefix-in-table", lambda s: z3.And(s.FR >= 0, s.FR <= s.NF, s.NF <= s.NA)),
        ("P1-future", lambda s: lo(s.p) >= s.FR),
        ("P2-future", lambda s: z3.Implies(s.st == RUN, lo(s.p + s.L) >= s.NF)),
    ]
    single = [
        ("live-step-shape", lambda s, j: z3.Implies(s.live(j), z3.And(
            s.N(j) >= 1, s.N(j) <= prm.M, s.K(j) >= 0, s.K(j) <= s.N(j) - 1, s.K(j) <= prm.S,
            s.TAB(j), s.WS(j) >= s.p + s.L, s.A(j) >= s.p + s.L, s.A(j) + s.N(j) <= s.c))),
        ("live-steps-adjacent", lambda s, j: z3.Implies(
            z3.And(s.dq <= j, j + 1 < s.q),
            z3.And(s.A(j + 1) == s.A(j) + s.N(j),
                   s.WS(j + 1) == s.WS(j) + s.N(j) - s.K(j)))),
        ("old-table-unread", lambda s, j: z3.Implies(
            z3.And(s.st != RUN, j >= 0, j < s.q), z3.Not(s.TAB(j)))),
        ("discarded-readers-above-p", lambda s, j: z3.Implies(
            z3.And(j >= 0, j < s.dq, s.TAB(j)), s.WS(j) >= s.p)),
        ("P1-in-flight", lambda s, j: z3.Implies(
            z3.And(j >= 0, j < s.q, s.TAB(j)), lo(s.WS(j)) >= s.FR)),
        ("P2-in-flight", lambda s, j: z3.Implies(
            s.live(j), z3.And(s.NFS(j) <= s.NF, lo(s.WS(j)) >= s.NF))),
    ]
    pair = [
        ("steps-ordered", lambda s, i, j: z3.Implies(
            z3.And(s.dq <= i, i < j, j < s.q),
            z3.And(s.A(j) >= s.A(i) + s.N(i), s.WS(j) >= s.WS(i) + s.N(i) - s.K(i)))),
    ]
    return Invariant(scalar, single, pair)


def bound_tokens_ahead(prm: Params, ar: Arith):
    """Tokens the settled manager may hold beyond the settled count: every
    in-flight step a full batch, ``D*M``. (A connector's load adds nothing:
    admission NULL-pads the slots before the window of the first computed
    position, so the loaded range counts as settled for the table.)"""
    return ar.mul(prm.D)


def bound_invariant(prm: Params, ar: Arith, formula: str = "code", ahead=None) -> Invariant:
    """Live blocks (``NA - NF``) never exceed ``live_bound(g, B, max_model_len,
    D*M)`` (``formula="code"``, the function in ``model/windows.py``, as the
    reference sizes its pool) or :func:`exact_bound_tokens` (``formula="exact"``),
    with the bookkeeping that makes it inductive. ``ahead`` overrides the tokens
    ahead (``prm.M`` is the sizing before the fix)."""
    ahead = bound_tokens_ahead(prm, ar) if ahead is None else ahead
    bound_fn = {"code": live_bound_tokens, "exact": exact_bound_tokens}[formula]
    scalar = [
        ("table-covers-high-water", lambda s: z3.And(ar.cb(s.H) == s.NA, s.c <= s.H,
                                                     s.H <= prm.T, prm.maxlen - 1 >= s.H,
                                                     s.L <= prm.E)),
        ("high-water-ahead", lambda s: s.H - s.p - s.L <= ar.mul(prm.D)),
        ("load-padded", lambda s: z3.Implies(s.L > 0, ar.fb(
            skipped(prm.kind, s.p + s.L, prm.W, ar)) <= s.NF)),
        (f"live-bound-{formula}", lambda s: bound_fn(prm.kind, prm.maxlen, ahead, prm.W, ar)
         >= s.NA - s.NF),
    ]
    single = [
        ("in-flight-batches", lambda s, j: z3.Implies(s.live(j),
                                                      s.c - s.A(j) <= ar.mul(s.q - j))),
    ]
    return Invariant(scalar, single, [])


def violation_p1(pre: State, post: State, j, ar: Arith, prm: Params) -> z3.BoolRef:
    """Property 1 at a schedule: the blocks freed now (``[pre NF, post NF)``) meet the
    read set of step ``j`` as it was scheduled (blocks of ``[lo(AS(j)), AS(j)+N(j))``)."""
    lo = window_lo(prm.kind, pre.AS(j), prm.W, ar)
    return z3.And(pre.live(j), pre.TAB(j),
                  zmax(pre.NF, ar.fb(lo)) < zmin(post.NF, pre.AS(j) + pre.N(j)))


def violation_p2(post: State, j, ar: Arith, prm: Params) -> z3.BoolRef:
    """Property 2 after a rejection: step ``j``, shifted down, reads below the null
    prefix of the table it was scheduled with."""
    lo = window_lo(prm.kind, post.A(j), prm.W, ar)
    return z3.And(post.live(j), post.TAB(j), ar.fb(lo) < post.NFS(j))
