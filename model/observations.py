"""Observations: what a target reports, and all that properties may read.

``Target.apply(event)`` returns an :class:`Observed`: the things that happened
while the event ran, in the order they happened (``items``), and a snapshot of
counters afterwards (``counters``).

Item kinds:

* :class:`StepObs`: a step was scheduled. For each request in it: the
  interval ``[start, end)`` of positions it computes (spec tokens included,
  the last ``spec`` of them are drafts), the tokens a connector loads for it in
  this step (positions ``[start - loaded, start)``), and per KV-cache group the
  full block table (physical ids, ``NULL`` = 0) it was scheduled with.
* :class:`AllocObs`: a physical block was handed to a request (a new block or
  a prefix-cache hit) at a logical slot of a group.
* :class:`FreeObs`: a request let go of a physical block (its reference was
  dropped; with prefix caching the block may stay cached in the pool), and
  why: ``window`` (out of the attention window), ``finish``, ``abort``,
  ``preempt``, ``failed_load``, ``copy`` (a copy's hold, :class:`CopyObs`),
  ``dedup`` (the prefix cache already held the same KV: the request's copy
  goes back and its slot names the cached block, SGLang's insert).
* :class:`MoveObs`: a request's block moved from one logical slot to another
  of the same group, its old slot now NULL (vLLM's Mamba align mode relocates
  a speculative state block past the new running state); no reference changes.
* :class:`CopyObs`: a copy of a block's KV into a fresh block is queued
  (vLLM's copy-on-write of a prefix hit that ends inside a block); both blocks
  are held by the copy until a ``copy`` free returns each. The copy itself
  runs with the next step (``StepObs.copies``).
* :class:`ProcessObs`: the oldest unprocessed step's output was handed back,
  with the drafts accepted per request and the requests whose output was
  discarded (preempted, finished or failed meanwhile).
* :class:`FinishObs`: a request ended (finished on its own by reaching
  ``max_new_tokens``, or by a Finish/Abort event).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import index as _index

NULL = 0

_BITS = 5
_K = 1 << _BITS  # slots per leaf, children per inner node
_MASK = _K - 1


class BlockTable(Sequence):
    """A block table (logical slot -> physical id, ``NULL`` = 0) too long for
    one tuple per step: a read-only sequence equal to, hashed, ordered and
    printed as the tuple of its ids, stored as a tree of tuples of
    :data:`_K` (leaves of ids, inner nodes of children) so that a table made
    from the one before it (:meth:`of`) shares every leaf and node that did
    not change. A long decode hands its steps one table per change of its
    block table; as tuples each costs its length (memory quadratic in the
    decode), as trees each costs the leaves it changed and their paths.
    Tables of up to :data:`_K` slots stay plain tuples (:meth:`of`)."""

    __slots__ = ("_n", "_shift", "_root")

    def __init__(self, n: int, shift: int, root: tuple) -> None:
        self._n = n
        self._shift = shift  # 0: the root is a leaf; else each level down takes _BITS off
        self._root = root

    @classmethod
    def of(cls, ids: Sequence[int], prev: Sequence[int] | None = None
           ) -> tuple[int, ...] | BlockTable:
        """``ids`` as a table: a tuple if it has up to :data:`_K` slots, else a
        tree sharing the leaves equal to ``prev``'s at the same place and the
        inner nodes whose children all are ``prev``'s (``prev``: a table made
        by ``of``, or None)."""
        t = ids if type(ids) is tuple else tuple(ids)
        n = len(t)
        if n <= _K:
            return t
        old = _levels(prev)  # prev's nodes per level, leaves first
        level = [t[i:i + _K] for i in range(0, n, _K)]
        if old:
            was = old[0]
            for i in range(min(len(level), len(was))):
                if level[i] == was[i]:
                    level[i] = was[i]
        shift = 0
        depth = 0
        while len(level) > 1:
            depth += 1
            shift += _BITS
            was = old[depth] if depth < len(old) else ()
            up = []
            for j in range(0, len(level), _K):
                node = tuple(level[j:j + _K])
                k = j >> _BITS
                if k < len(was):
                    w = was[k]
                    if len(w) == len(node) and all(a is b for a, b in zip(w, node, strict=True)):
                        node = w
                up.append(node)
            level = up
        return cls(n, shift, level[0])

    def _leaves(self):
        if not self._shift:
            return (self._root,)
        nodes = self._root
        for _ in range(self._shift // _BITS - 1):
            nodes = [c for node in nodes for c in node]
        return nodes

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if type(i) is not int:
            if isinstance(i, slice):
                return tuple(self)[i]
            i = _index(i)
        n = self._n
        if i < 0:
            i += n
            if i < 0:
                raise IndexError("block table index out of range")
        elif i >= n:
            raise IndexError("block table index out of range")
        node = self._root
        s = self._shift
        while s:
            node = node[(i >> s) & _MASK]
            s -= _BITS
        return node[i & _MASK]

    def __iter__(self):
        return chain.from_iterable(self._leaves())

    def __reversed__(self):
        return reversed(tuple(self))

    def __contains__(self, x) -> bool:
        return any(x in leaf for leaf in self._leaves())

    def _flat(self, other) -> tuple | None:
        if isinstance(other, BlockTable):
            return tuple(other)
        if isinstance(other, tuple):
            return other
        return None

    def __eq__(self, other) -> bool:
        if other is self:
            return True
        if isinstance(other, BlockTable):
            if other._n != self._n:
                return False
            if other._root is self._root:
                return True
        elif not isinstance(other, tuple):
            return NotImplemented
        elif len(other) != self._n:
            return False
        return tuple(self) == self._flat(other)

    def __ne__(self, other) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __lt__(self, other):
        o = self._flat(other)
        return NotImplemented if o is None else tuple(self) < o

    def __le__(self, other):
        o = self._flat(other)
        return NotImplemented if o is None else tuple(self) <= o

    def __gt__(self, other):
        o = self._flat(other)
        return NotImplemented if o is None else tuple(self) > o

    def __ge__(self, other):
        o = self._flat(other)
        return NotImplemented if o is None else tuple(self) >= o

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        o = self._flat(other)
        return NotImplemented if o is None else tuple(self) + o

    def __radd__(self, other):
        o = self._flat(other)
        return NotImplemented if o is None else o + tuple(self)

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self):
        # the nodes as they are: pickle writes a node shared by several tables once
        return (BlockTable, (self._n, self._shift, self._root))


def _levels(t: Sequence[int] | None) -> list[list[tuple]]:
    """A table's nodes per level, leaves first (a tuple table: its one leaf)."""
    if t is None:
        return []
    if not isinstance(t, BlockTable):
        return [[t]] if type(t) is tuple and len(t) <= _K else []
    out = [[t._root]]
    for _ in range(t._shift // _BITS):
        out.append([c for node in out[-1] for c in node])
    out.reverse()
    return out


@dataclass(frozen=True, slots=True)
class ReqStep:
    rid: str
    start: int
    end: int
    spec: int = 0  # draft tokens among [start, end): the last `spec` positions
    loaded: int = 0  # positions [start - loaded, start) loaded by a connector in this step
    # per group, logical slot -> physical id: a tuple, or a BlockTable (a long one)
    tables: tuple[tuple[int, ...] | BlockTable, ...] = ()


@dataclass(frozen=True, slots=True)
class StepObs:
    step: int  # 0, 1, 2, ... in schedule order
    reqs: tuple[ReqStep, ...]
    # (src, dst): block copies the worker runs before this step's forward, all
    # at once (every source read before any destination is written)
    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class AllocObs:
    block: int
    group: int
    rid: str
    logical: int
    cached: bool = False  # a prefix-cache hit (the block may be shared)


@dataclass(frozen=True, slots=True)
class FreeObs:
    block: int
    group: int
    rid: str
    logical: int
    reason: str


@dataclass(frozen=True, slots=True)
class MoveObs:
    block: int
    group: int
    rid: str
    logical: int  # the slot it left (now NULL)
    to: int  # the slot it holds now


@dataclass(frozen=True, slots=True)
class CopyObs:
    """A copy of ``src``'s KV into ``dst`` (fresh) is queued for the next step
    (it runs when a step lists it in ``StepObs.copies``); the copy holds a
    reference of each until it ran (a ``copy`` :class:`FreeObs` of ``rid``
    returns each). ``logical >= 0``: the request's
    slot ``logical`` of ``group``, a prefix hit ending inside the block, moves
    from ``src`` to ``dst``, its private copy (the request's reference of
    ``src`` becomes the copy's). ``logical == -1``: the request keeps writing
    ``src`` and ``dst`` keeps ``src``'s prefix-cache entry (vLLM's Mamba state
    at a prompt's last hash boundary, overwritten by the request's next step)."""

    src: int
    dst: int
    group: int
    rid: str
    logical: int


@dataclass(frozen=True, slots=True)
class ProcessObs:
    step: int
    accepted: tuple[tuple[str, int], ...] = ()  # (rid, accepted drafts)
    discarded: tuple[str, ...] = ()  # requests whose output in this step was dropped
    failed: tuple[tuple[str, int], ...] = ()  # (rid, first bad block) of a failed load


@dataclass(frozen=True, slots=True)
class FinishObs:
    rid: str
    reason: str  # "length", "finish", "abort"; "error" (a failed load, policy "fail")


Item = StepObs | AllocObs | FreeObs | MoveObs | CopyObs | ProcessObs | FinishObs


@dataclass(frozen=True, slots=True)
class ReqCounters:
    computed: int  # num_computed_tokens (optimistic count c)
    in_flight: int | None  # num_in_flight_tokens where the target has it, else None
    live: tuple[int, ...]  # non-NULL blocks held, per group
    status: str = "running"  # waiting | running | preempted | finished


@dataclass(frozen=True, slots=True)
class Counters:
    free_blocks: int  # blocks in the pool's free queue (cached-but-free included)
    total_blocks: int  # the pool, NULL block included
    # the requests whose counters the event may have changed (added, admitted,
    # scheduled, processed, preempted, finished, or whose blocks moved); one not
    # listed keeps the counters it was last listed with. A finished one is listed
    # (status "finished") in the event it ended in, or, while blocks of its own
    # still wait to leave it, until the event they do; then it is gone.
    # ``LiveCounters`` folds them into every live request's counters.
    reqs: dict[str, ReqCounters] = field(default_factory=dict)
    bound: tuple[int, ...] = ()  # per group: the live-block bound the target sizes for
    # what the target's own pool structures show broken, one line each (a
    # block twice in its free queue, a reference count below zero, a block
    # with references left in the free queue): property 3, after every event
    pool_faults: tuple[str, ...] = ()


class LiveCounters(dict[str, ReqCounters]):
    """Every live request's counters, folded from the events' :class:`Counters`
    (which list only what each event may have changed): after ``update(c)`` it
    holds every request not finished, in the order they were first listed, and
    those listed finished in ``c`` (dropped at the next update). Each update
    costs what ``c`` lists, not what is live."""

    def __init__(self) -> None:
        super().__init__()
        self._finished: list[str] = []

    def update(self, c: Counters | None) -> None:  # type: ignore[override]
        if c is None:
            return
        for rid in self._finished:
            rc = self.get(rid)
            if rc is not None and rc.status == "finished":
                del self[rid]
        self._finished = []
        for rid, rc in c.reqs.items():
            self[rid] = rc
            if rc.status == "finished":
                self._finished.append(rid)

    def live(self) -> list[str]:
        """The requests not finished, in the order they were first listed."""
        return [rid for rid, rc in self.items() if rc.status != "finished"]


@dataclass(slots=True)
class Observed:
    items: list[Item] = field(default_factory=list)
    counters: Counters | None = None
