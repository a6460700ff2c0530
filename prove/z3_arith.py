"""Block arithmetic for the Z3 encoding, and the lemmas that tame it.

Everything the freeing model needs from ``//`` is a multiple of a symbolic
block size ``B`` (or chunk ``C``) and a product with the symbolic batch budget
``M``::

    fb(x) = floor(x/B)*B      cb(x) = ceil(x/B)*B      fc(x) = floor(x/C)*C
    mul(x) = x*M

    x:        0  1  2  3  4  5  6  7  8  9          (B = 4)
    blocks:  [ 0        | 1         | 2    ...
    fb(6) = 4 ---------^             cb(6) = 8

With ``B``, ``C`` and ``M`` symbolic these are nonlinear. An :class:`Arith` has
two modes:

* ``concrete``: the real terms, ``(x / B) * B`` with Z3's integer division
  (floor for ``B > 0``, like Python's ``//``). The correspondence tests and
  the bounded searches for counterexamples use this mode.
* ``abstract``: each of ``fb``, ``cb``, ``fc``, ``mul`` is an uninterpreted
  function, and the proofs get only the facts listed in :data:`LEMMAS`,
  instantiated on the ground terms of each query (:meth:`Arith.instances`).
  Each lemma is proved once, for all integers, in the concrete mode
  (:func:`prove_lemmas`), so a proof in the abstract mode is a proof about the
  real terms. The queries stay in linear arithmetic with uninterpreted
  functions, which Z3 decides quickly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import z3


def zmax(a, b):
    return z3.If(a >= b, a, b)


def zmin(a, b):
    return z3.If(a <= b, a, b)


class Arith:
    """``fb``/``cb``/``fc``/``mul`` for one block size ``B``, chunk ``C`` and budget ``M``."""

    def __init__(self, B, C=None, M=None, abstract: bool = False, tag: str = ""):
        self.B = B
        self.C = C
        self.M = M
        self.abstract = abstract
        if abstract:
            ints = (z3.IntSort(), z3.IntSort())
            self.FB = z3.Function(f"floorB{tag}", *ints)
            self.CB = z3.Function(f"ceilB{tag}", *ints)
            self.FC = z3.Function(f"floorC{tag}", *ints)
            self.MUL = z3.Function(f"mulM{tag}", *ints)

    # ------------------------------------------------------------- the terms

    def fb(self, x):
        """``floor(x/B)*B``: the start of the block holding position ``x``."""
        return self.FB(x) if self.abstract else (x / self.B) * self.B

    def cb(self, x):
        """``ceil(x/B)*B``: ``x`` rounded up to whole blocks."""
        return self.CB(x) if self.abstract else ((x + self.B - 1) / self.B) * self.B

    def fc(self, x):
        """``floor(x/C)*C``: the start of the chunk holding position ``x``."""
        if self.C is None:
            raise ValueError("this Arith has no chunk size")
        return self.FC(x) if self.abstract else (x / self.C) * self.C

    def mul(self, x):
        """``x*M``: ``x`` full batches."""
        if self.M is None:
            raise ValueError("this Arith has no budget")
        return self.MUL(x) if self.abstract else x * self.M

    def blocks_floor(self, x):
        """``x // B`` (concrete mode only: block counts, for the correspondence tests)."""
        assert not self.abstract
        return x / self.B

    def blocks_ceil(self, x):
        """``cdiv(x, B)`` (concrete mode only)."""
        assert not self.abstract
        return (x + self.B - 1) / self.B

    def is_multiple(self, x):
        """``x`` is a multiple of ``B``."""
        return self.fb(x) == x

    def side_conditions(self) -> list:
        """Facts about the parameters themselves (``B >= 1``, ...)."""
        out = [self.B >= 1]
        if self.C is not None:
            out.append(self.C >= 1)
        if self.M is not None:
            out.append(self.M >= 0)
        if self.abstract:
            out += [self.FB(0) == 0, self.CB(0) == 0]
            if self.C is not None:
                out.append(self.FC(0) == 0)
            if self.M is not None:
                out += [self.MUL(0) == 0, self.MUL(1) == self.M]
        return out

    # ----------------------------------------------------- lemma instances

    def instances(self, formulas, lemmas=None, max_rounds: int = 2) -> list:
        """Instances of :data:`LEMMAS` (or of those named in ``lemmas``) on the
        ground ``fb``/``cb``/``fc``/``mul`` terms of ``formulas`` (empty in the
        concrete mode). Round 2 instantiates on the terms round 1 introduced."""
        if not self.abstract:
            return []
        chosen = [lem for lem in LEMMAS if lem.auto and (lemmas is None or lem.name in lemmas)]
        decls = {d.name(): d for d in (self.FB, self.CB, self.FC, self.MUL)}
        seen_terms: set[int] = set()
        old: dict[str, list] = {n: [] for n in decls}
        out: list = []
        seen_inst: set[int] = set()
        work = list(formulas)
        for _ in range(max_rounds):
            new = _collect_apps(work, decls, seen_terms, old)
            if not any(new.values()):
                break
            work = []
            for lem in chosen:
                for inst in lem.instantiate(self, old, new):
                    key = inst.get_id()
                    if key not in seen_inst:
                        seen_inst.add(key)
                        work.append(inst)
            for n in decls:
                old[n] = old[n] + new[n]
            out += work
        return out


def _collect_apps(formulas, decls: dict, seen: set, old: dict) -> dict:
    """``{decl name: [argument terms]}`` of the applications of ``decls`` in
    ``formulas`` not met before (``seen``: term ids already visited; ``old``:
    arguments already known)."""
    known = {n: {a.get_id() for a in v} for n, v in old.items()}
    found: dict[str, dict[int, z3.ExprRef]] = {n: {} for n in decls}
    stack = list(formulas)
    while stack:
        e = stack.pop()
        k = e.get_id()
        if k in seen:
            continue
        seen.add(k)
        if z3.is_app(e):
            if e.num_args() == 1:
                d = e.decl()
                name = d.name()
                if name in decls and d == decls[name]:
                    arg = e.arg(0)
                    if arg.get_id() not in known[name]:
                        found[name][arg.get_id()] = arg
            stack.extend(e.children())
    return {n: list(v.values()) for n, v in found.items()}


# -------------------------------------------------------------------- lemmas


@dataclass(frozen=True)
class Lemma:
    """A fact about the block arithmetic, proved once for all integers.

    ``statement(ar, x, y)`` builds it over the concrete terms (``x``, ``y``
    universally quantified, ``B``, ``C``, ``M`` symbolic with ``B, C >= 1``,
    ``M >= 0``); ``instantiate(ar, old, new)`` yields its instances on the
    ground terms of a query in the abstract mode (``{function: [arguments]}``,
    each instance using at least one argument of ``new``)."""

    name: str
    text: str
    statement: Callable
    instantiate: Callable
    auto: bool = True  # instantiated on every query; else only where a proof asks (hint)


def _unary(fn_name: str, body):
    def inst(ar: Arith, old: dict, new: dict):
        return [body(ar, x) for x in new.get(getattr(ar, fn_name).name(), [])]

    return inst


def _new_pairs(old_xs: list, new_xs: list):
    """Unordered pairs of distinct terms with at least one new."""
    for i, x in enumerate(new_xs):
        for y in old_xs:
            yield x, y
        for y in new_xs[i + 1:]:
            yield x, y


def _pairs(fn_name: str, body):
    """``body(x, y)`` and ``body(y, x)`` on the pairs of arguments of ``fn``."""
    def inst(ar: Arith, old: dict, new: dict):
        n = getattr(ar, fn_name).name()
        out = []
        for x, y in _new_pairs(old.get(n, []), new.get(n, [])):
            out += [body(ar, x, y), body(ar, y, x)]
        return out

    return inst


def _mono_pairs(fn_name: str):
    """Monotonicity on the pairs of arguments of ``fn``, one instance per pair."""
    def inst(ar: Arith, old: dict, new: dict):
        n = getattr(ar, fn_name).name()
        f = getattr(ar, fn_name.lower() if fn_name != "MUL" else "mul")
        return [z3.If(x <= y, f(x) <= f(y), f(y) <= f(x))
                for x, y in _new_pairs(old.get(n, []), new.get(n, []))]

    return inst


def _fb_bounds(ar, x):
    return z3.And(ar.fb(x) <= x, x < ar.fb(x) + ar.B, z3.Implies(x >= 0, ar.fb(x) >= 0))


def _cb_bounds(ar, x):
    return z3.And(x <= ar.cb(x), ar.cb(x) < x + ar.B, z3.Implies(x >= 0, ar.cb(x) >= 0))


def _fc_bounds(ar, x):
    return z3.And(ar.fc(x) <= x, x < ar.fc(x) + ar.C, z3.Implies(x >= 0, ar.fc(x) >= 0))


def _mono(fn):
    return lambda ar, x, y: z3.Implies(x <= y, getattr(ar, fn)(x) <= getattr(ar, fn)(y))


def _cb_minus_fb(ar, x, y):
    return ar.cb(x) - ar.fb(y) <= ar.cb(x - y) + ar.B


def _cb_minus_fb_tight(ar, x, y):
    return z3.Implies(x >= y, ar.cb(x) - ar.fb(y) <= ar.cb(x - y - 1) + ar.B)


def _no_auto(ar, old, new):
    return []


def _fc_multiple_of_b(ar, x):
    return z3.Implies(ar.is_multiple(ar.C), ar.is_multiple(ar.fc(x)))


def _mul_step(ar, x):
    return ar.mul(x + 1) == ar.mul(x) + ar.M


def _mul_step_pair(ar, x, y):
    return z3.Implies(y == x + 1, ar.mul(y) == ar.mul(x) + ar.M)


def _mul_mono(ar, x, y):
    return z3.Implies(z3.And(x >= 0, x <= y), ar.mul(x) <= ar.mul(y))


def _mul_nonneg(ar, x):
    return z3.Implies(x >= 0, ar.mul(x) >= 0)


def _fb_of_cb(ar, x):
    return ar.is_multiple(ar.cb(x))


LEMMAS: tuple[Lemma, ...] = (
    Lemma("zero", "fb(0) = cb(0) = fc(0) = mul(0) = 0 and mul(1) = M (given as facts)",
          lambda ar, x, y: z3.And(ar.fb(0) == 0, ar.cb(0) == 0, ar.fc(0) == 0, ar.mul(0) == 0,
                                  ar.mul(1) == ar.M),
          lambda ar, old, new: []),
    Lemma("floor-bounds", "fb(x) <= x < fb(x) + B, and fb(x) >= 0 for x >= 0",
          lambda ar, x, y: _fb_bounds(ar, x), _unary("FB", _fb_bounds)),
    Lemma("floor-mono", "x <= y -> fb(x) <= fb(y)",
          lambda ar, x, y: _mono("fb")(ar, x, y), _mono_pairs("FB")),
    Lemma("ceil-bounds", "x <= cb(x) < x + B, and cb(x) >= 0 for x >= 0",
          lambda ar, x, y: _cb_bounds(ar, x), _unary("CB", _cb_bounds)),
    Lemma("ceil-mono", "x <= y -> cb(x) <= cb(y)",
          lambda ar, x, y: _mono("cb")(ar, x, y), _mono_pairs("CB")),
    Lemma("ceil-is-multiple", "fb(cb(x)) = cb(x)",
          lambda ar, x, y: _fb_of_cb(ar, x), _unary("CB", _fb_of_cb)),
    Lemma("ceil-minus-floor", "cb(x) - fb(y) <= cb(x - y) + B  (a span touches one block more)",
          _cb_minus_fb, _no_auto, auto=False),
    Lemma("ceil-minus-floor-tight",
          "x >= y -> cb(x) - fb(y) <= cb(x - y - 1) + B  (blocks touched by [y, x))",
          _cb_minus_fb_tight, _no_auto, auto=False),
    Lemma("ceil-shift", "cb(x - fb(y)) = cb(x) - fb(y)  (block-aligned shift)",
          lambda ar, x, y: ar.cb(x - ar.fb(y)) == ar.cb(x) - ar.fb(y), _no_auto, auto=False),
    Lemma("chunk-bounds", "fc(x) <= x < fc(x) + C, and fc(x) >= 0 for x >= 0",
          lambda ar, x, y: _fc_bounds(ar, x), _unary("FC", _fc_bounds)),
    Lemma("chunk-mono", "x <= y -> fc(x) <= fc(y)",
          lambda ar, x, y: _mono("fc")(ar, x, y), _mono_pairs("FC")),
    Lemma("chunk-block-aligned",
          "C = k*B -> fb(fc(x)) = fc(x)  (used with k = C/B, i.e. fb(C) = C)",
          lambda ar, x, y: z3.Implies(y * ar.B == ar.C, ar.is_multiple(ar.fc(x))),
          _unary("FC", _fc_multiple_of_b)),
    Lemma("mul-step", "mul(x + 1) = mul(x) + M",
          lambda ar, x, y: _mul_step(ar, x),
          lambda ar, old, new: _unary("MUL", _mul_step)(ar, old, new)
          + _pairs("MUL", _mul_step_pair)(ar, old, new)),
    Lemma("mul-mono", "0 <= x <= y -> mul(x) <= mul(y), and mul(x) >= 0 for x >= 0",
          lambda ar, x, y: z3.And(_mul_mono(ar, x, y), _mul_nonneg(ar, x)),
          lambda ar, old, new: _pairs("MUL", _mul_mono)(ar, old, new)
          + _unary("MUL", _mul_nonneg)(ar, old, new)),
)


def check_nonlinear(assertions, timeout_ms: int = 20000):
    """``check()`` for nonlinear queries, robustly: Z3's nonlinear procedures are
    sensitive to variable order and seeds, so try a few configurations in turn,
    each with a share of the time. Returns the first definite answer."""
    configs = (("QF_NIA", 0), (None, 0), ("QF_NIA", 3), (None, 5), ("QF_NIA", 11))
    per = max(1000, timeout_ms // len(configs))
    r = z3.unknown
    for logic, seed in configs:
        sol = z3.SolverFor(logic) if logic else z3.Solver()
        sol.set(timeout=per)
        if seed:
            sol.set(random_seed=seed)
        sol.add(*assertions)
        r = sol.check()
        if r != z3.unknown:
            return r
    return r


@dataclass(frozen=True)
class LemmaResult:
    name: str
    text: str
    status: str  # proved | unknown | refuted
    seconds: float


LEMMA_BY_NAME = {lem.name: lem for lem in LEMMAS}


def hint(name: str, ar: Arith, x, y=None):
    """An instance of lemma ``name`` at ``x``, ``y`` that a proof asks for by name
    (the lemmas with ``auto=False``: their instances would make new terms)."""
    return LEMMA_BY_NAME[name].statement(ar, x, y)


_LEMMA_CACHE: list[LemmaResult] | None = None


def prove_lemmas(timeout_ms: int = 20000) -> list[LemmaResult]:
    """Prove every lemma for all integers ``x, y`` and all ``B, C >= 1``, ``M >= 0``
    over the concrete (nonlinear) terms. Cached: the lemmas do not change."""
    global _LEMMA_CACHE
    if _LEMMA_CACHE is not None:
        return _LEMMA_CACHE
    x, y, B, C, M = z3.Ints("x y B C M")
    ar = Arith(B, C, M)
    out = []
    for lem in LEMMAS:
        t0 = time.perf_counter()
        r = check_nonlinear([B >= 1, C >= 1, M >= 0, z3.Not(lem.statement(ar, x, y))],
                            timeout_ms)
        status = "proved" if r == z3.unsat else "refuted" if r == z3.sat else "unknown"
        out.append(LemmaResult(lem.name, lem.text, status, time.perf_counter() - t0))
    _LEMMA_CACHE = out
    return out
