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

from dataclasses import dataclass, field

NULL = 0


@dataclass(frozen=True)
class ReqStep:
    rid: str
    start: int
    end: int
    spec: int = 0  # draft tokens among [start, end): the last `spec` positions
    loaded: int = 0  # positions [start - loaded, start) loaded by a connector in this step
    tables: tuple[tuple[int, ...], ...] = ()  # per group, logical slot -> physical id


@dataclass(frozen=True)
class StepObs:
    step: int  # 0, 1, 2, ... in schedule order
    reqs: tuple[ReqStep, ...]
    # (src, dst): block copies the worker runs before this step's forward, all
    # at once (every source read before any destination is written)
    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class AllocObs:
    block: int
    group: int
    rid: str
    logical: int
    cached: bool = False  # a prefix-cache hit (the block may be shared)


@dataclass(frozen=True)
class FreeObs:
    block: int
    group: int
    rid: str
    logical: int
    reason: str


@dataclass(frozen=True)
class MoveObs:
    block: int
    group: int
    rid: str
    logical: int  # the slot it left (now NULL)
    to: int  # the slot it holds now


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class ProcessObs:
    step: int
    accepted: tuple[tuple[str, int], ...] = ()  # (rid, accepted drafts)
    discarded: tuple[str, ...] = ()  # requests whose output in this step was dropped
    failed: tuple[tuple[str, int], ...] = ()  # (rid, first bad block) of a failed load


@dataclass(frozen=True)
class FinishObs:
    rid: str
    reason: str  # "length", "finish", "abort"; "error" (a failed load, policy "fail")


Item = StepObs | AllocObs | FreeObs | MoveObs | CopyObs | ProcessObs | FinishObs


@dataclass(frozen=True)
class ReqCounters:
    computed: int  # num_computed_tokens (optimistic count c)
    in_flight: int | None  # num_in_flight_tokens where the target has it, else None
    live: tuple[int, ...]  # non-NULL blocks held, per group
    status: str = "running"  # waiting | running | preempted | finished


@dataclass(frozen=True)
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


@dataclass
class Observed:
    items: list[Item] = field(default_factory=list)
    counters: Counters | None = None
