"""Counterexample reports: a terminal timeline, a picture, a pytest reproducer.

A reviewer gets three views of one violating trace (a :class:`ReplayResult`):

* :func:`render_timeline`, the terminal story (``properties.replay.format_timeline``
  delegates here): one block per event with each request's counts
  ``p`` (processed) / ``f`` (in flight) / ``c`` (optimistic), its block table
  and, under it, the logical blocks each unprocessed step may read::

      >>  #2  Schedule()  -> step 1
                r0 returns block 1@0, 2@1, 3@2 (window)
                r0  running  p=0 f=100 c=100
                    sliding(W=16)   0     1     2     3     4     5     6
                    table         >1*<   2*    3*    4     5     6     7
                    step 0        [=======================]             reads [0, 64)
                    step 1                          [=================] reads [49, 100)

  ``1*`` went back to the pool during this event, ``.`` is a NULL slot,
  ``.>r1`` a NULL slot whose old block another request now holds, ``>1*<``
  the violating block.

* :func:`build_grid` / :func:`render_png`: the same story as a picture,
  logical blocks (x) against events (y), one panel per request and KV-cache
  group; each cell coloured by its state (:data:`STATES`), the unprocessed
  steps' read windows drawn over the rows, the violation circled. The
  :class:`Grid` is the picture's data, so a test can assert what it shows.

* :func:`write_reproducer`: a standalone pytest file that embeds the trace
  and replays it on ``$KVCHECK_TARGET`` (default: the target it failed on),
  asserting that every property holds: it fails on the buggy target and
  passes on a fixed one.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from impl.target import layout_note
from model.events import AddRequest, Config, Event, Schedule, Trace
from model.observations import (
    NULL,
    AllocObs,
    CopyObs,
    FinishObs,
    FreeObs,
    ProcessObs,
    StepObs,
)
from model.windows import read_blocks
from properties.invariants import Checker, Violation
from properties.replay import ReplayResult

REPO_ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ the grid

STATES = {
    "none": "no block (not allocated, or released and not reused)",
    "live": "held by the request",
    "freed": "returned to the pool during this event",
    "null": "NULL slot: freed earlier, the block is in the pool",
    "released": "the request let go of it (finish, abort, preempt, failed load)",
    "reused": "the block it held is now held by another request or slot",
}


@dataclass(frozen=True)
class Lane:
    """One panel of the picture: one request in one KV-cache group."""

    rid: str
    group: int
    label: str


@dataclass(frozen=True)
class Cell:
    state: str  # a key of STATES
    block: int | None = None  # the physical block held, or the one last held there
    by: str | None = None  # for ``reused``: who holds that block now


@dataclass(frozen=True)
class ReqCounts:
    p: int | None  # processed (settled) count, as the checker derives it
    f: int  # in flight: reported by the target, else the checker's shadow
    c: int | None  # optimistic count (num_computed_tokens)
    f_reported: bool  # whether the target reports num_in_flight_tokens
    status: str


@dataclass(frozen=True)
class ReadWindow:
    """The logical blocks ``[first, last]`` that unprocessed step ``step`` may
    read for request ``rid`` in group ``group``, as it stands after event row
    ``row`` (rejections of earlier drafts taken at their worst)."""

    row: int
    step: int
    rid: str
    group: int
    first: int
    last: int
    start: int  # lowest position it may compute
    end: int  # one past the highest
    dead: bool  # its output will be discarded; the kernel still runs

    def covers(self, logical: int) -> bool:
        return self.first <= logical <= self.last


@dataclass(frozen=True)
class Mark:
    """Where the (first) violation shows in the grid."""

    row: int
    prop: int
    message: str
    rid: str | None = None
    group: int | None = None
    logical: int | None = None
    block: int | None = None
    step: int | None = None  # the unprocessed step that reads it, if any


@dataclass(frozen=True)
class RowInfo:
    index: int  # the event's index in the trace
    event: Event
    label: str
    step: int | None  # the step this event scheduled
    # the requests this event may have changed (all of them in the first row
    # drawn), in ``Grid.rids`` order; every other one of the first ``nrids``
    # requests of ``Grid.rids`` reads as in the row before
    counts: dict[str, ReqCounts]
    notes: tuple[str, ...] = ()  # what happened: returns, outputs processed
    nrids: int = 0  # how many of ``Grid.rids`` exist after this event


@dataclass
class Grid:
    """The picture's data: ``cells[(rid, group)][row][logical]``."""

    config: Config
    target: str
    lanes: list[Lane]
    rows: list[RowInfo]
    cells: dict[tuple[str, int], list[list[Cell]]]
    windows: list[ReadWindow]
    mark: Mark | None
    width: int  # logical blocks across
    violations: list[Violation] = field(default_factory=list)
    crash: str | None = None
    first_index: int = 0  # the trace index of the first event shown (rows before are not)
    first_row: int = 0  # the replay row (``ReplayResult.rows``) of grid row 0
    rids: list[str] = field(default_factory=list)  # the requests drawn, in the order added
    _by_row: tuple[int, dict[int, list[ReadWindow]]] | None = field(
        default=None, init=False, repr=False, compare=False)

    def cell(self, rid: str, group: int, row: int, logical: int) -> Cell:
        rows = self.cells.get((rid, group))
        if rows is None:  # a lane never drawn: nothing in it, no window over it
            return Cell("none")
        line = rows[row]
        return line[logical] if logical < len(line) else Cell("none")

    def windows_at(self, row: int, rid: str | None = None,
                   group: int | None = None) -> list[ReadWindow]:
        if self._by_row is None or self._by_row[0] != len(self.windows):
            by: dict[int, list[ReadWindow]] = {}
            for w in self.windows:
                by.setdefault(w.row, []).append(w)
            self._by_row = (len(self.windows), by)
        return [w for w in self._by_row[1].get(row, ())
                if (rid is None or w.rid == rid) and (group is None or w.group == group)]

    def windows_over(self, rid: str, group: int, row: int, logical: int) -> list[ReadWindow]:
        """The unprocessed steps' windows at ``row`` that cover that cell."""
        return [w for w in self.windows_at(row, rid, group) if w.covers(logical)]

    def freed_under_window(self) -> ReadWindow | None:
        """If the violation is a block freed while an unprocessed step reads it:
        that step's window (covering the freed cell), else None."""
        m = self.mark
        if m is None or m.logical is None or m.rid is None or m.group is None:
            return None
        if self.cell(m.rid, m.group, m.row, m.logical).state != "freed":
            return None
        over = self.windows_over(m.rid, m.group, m.row, m.logical)
        if m.step is not None:
            over = [w for w in over if w.step == m.step] or over
        return over[0] if over else None


def _fmt_event(ev: Event) -> str:
    name = type(ev).__name__
    args = dict(vars(ev)) if hasattr(ev, "__dict__") else {}
    if not args:
        return f"{name}()"
    inner = ", ".join(f"{k}={v!r}" if k != "id" else repr(v) for k, v in args.items()
                      if not (k in ("external_tokens", "variant", "accepted") and not v))
    return f"{name}({inner})"


def build_grid(res: ReplayResult, target: str | None = None, shown: int | None = None) -> Grid:
    """Rebuild, event by event, what each request holds and what each
    unprocessed step may read, from the observations in ``res``. With
    ``shown``, only the last ``shown`` events (ending at the first violation)
    become rows: the ones before are followed, not drawn, so a long trace
    costs time linear in its length and memory for the rows shown; requests
    that finished before the first row shown (and hold nothing) are
    forgotten, not drawn. A row shown is worked out for the requests the
    event may have changed (those it names, those the checker's view of
    changed, those whose released block someone took or let go of); the
    others carry their cells and counts over from the row before, so a row
    costs what its event touches, not what is live."""
    cfg = res.trace.config
    first = 0
    if shown is not None:
        bad = next((i for i, row in enumerate(res.rows) if row.violations), len(res.rows) - 1)
        first = max(0, bad + 1 - shown)
    tables: dict[tuple[str, int], tuple[int, ...]] = {}  # the latest, of rows not drawn
    checker = Checker(cfg, content=False)  # follows the run; res holds the verdicts
    held: dict[tuple[str, int, int], int] = {}
    last: dict[tuple[str, int, int], int] = {}
    nulled: set[tuple[str, int, int]] = set()
    owners: dict[int, set[tuple[str, int, int]]] = {}
    lanes: list[Lane] = []
    widths: dict[tuple[str, int], int] = {}
    per_row_cells: list[dict[tuple[str, int], list[Cell]]] = []
    rows: list[RowInfo] = []
    windows: list[ReadWindow] = []
    counters_seen: dict[str, object] = {}
    rids: list[str] = []
    rid_set: set[str] = set()
    nheld: dict[str, int] = {}  # rid -> slots it holds (in ``held``)
    ended: set[str] = set()  # finished in a row not drawn: forgotten once it holds nothing
    lasts: dict[int, set[tuple[str, int, int]]] = {}  # block -> the slots ``last`` maps to it
    rid_pos: dict[str, int] = {}  # rid -> its place in ``rids``
    lanes_of: dict[str, list[Lane]] = {}
    cur: dict[tuple[str, int], list[Cell]] = {}  # each lane's cells in the latest row drawn
    prev_freed: set[str] = set()  # requests with a cell "freed" in the row before

    def set_last(key: tuple[str, int, int], blk: int) -> None:
        old = last.get(key)
        if old is not None and old != blk:
            lasts[old].discard(key)
        last[key] = blk
        lasts.setdefault(blk, set()).add(key)

    def forget() -> None:
        """Drop what is kept of the requests in ``ended`` that hold nothing."""
        gone = {rid for rid in ended if not nheld.get(rid)}
        if not gone:
            return
        ended.difference_update(gone)
        for d in (last, held):
            for key in [k for k in d if k[0] in gone]:
                if d is last:
                    lasts[d[key]].discard(key)
                del d[key]
        nulled.difference_update([k for k in nulled if k[0] in gone])
        for blk in list(owners):
            keep = {k for k in owners[blk] if k[0] not in gone}
            if keep:
                owners[blk] = keep
            else:
                del owners[blk]
        for rid in gone:
            nheld.pop(rid, None)
            counters_seen.pop(rid, None)
            for gi in range(len(cfg.groups)):
                widths.pop((rid, gi), None)
                tables.pop((rid, gi), None)
        lanes[:] = [ln for ln in lanes if ln.rid not in gone]
        rids[:] = [rid for rid in rids if rid not in gone]
        rid_set.difference_update(gone)
        rid_pos.clear()
        rid_pos.update((rid, i) for i, rid in enumerate(rids))
        for rid in gone:
            lanes_of.pop(rid, None)

    def lane_for(rid: str) -> None:
        if rid in rid_set:
            return
        rid_pos[rid] = len(rids)
        rids.append(rid)
        rid_set.add(rid)
        mine = lanes_of[rid] = []
        for gi, g in enumerate(cfg.groups):
            mine.append(Lane(rid, gi, f"{rid} · {g.label()}"))
            widths[(rid, gi)] = 0
        lanes.extend(mine)

    def grow(rid: str, gi: int, n: int) -> None:
        lane_for(rid)
        widths[(rid, gi)] = max(widths[(rid, gi)], n)

    mark: Mark | None = None
    cell = _cell_cache()  # equal cells are one object (a long table's NULL run, row after row)
    for r0, row in enumerate(res.rows):
        ev = row.event
        if isinstance(ev, AddRequest):
            lane_for(ev.id)
        checker.feed(ev, row.obs)
        r = r0 - first  # the row drawn; < 0: followed, not drawn
        if r == 0 or (r < 0 and len(ended) >= 256):
            forget()
        if r == 0 and tables:  # the NULL slots of the tables the rows not drawn ended with
            for (rid, gi), table in tables.items():
                for lg, blk in enumerate(table):
                    if blk == NULL and (rid, gi, lg) not in held:
                        nulled.add((rid, gi, lg))
            tables.clear()
        freed_now: set[tuple[str, int, int]] = set()
        step = None
        notes: list[str] = []
        returns: dict[tuple[str, str], list[str]] = {}
        for it in row.obs.items:
            if isinstance(it, AllocObs):
                key = (it.rid, it.group, it.logical)
                grow(it.rid, it.group, it.logical + 1)
                if key not in held:
                    nheld[it.rid] = nheld.get(it.rid, 0) + 1
                held[key] = it.block
                set_last(key, it.block)
                nulled.discard(key)
                owners.setdefault(it.block, set()).add(key)
            elif isinstance(it, CopyObs):
                key = (it.rid, it.group, it.logical)
                if it.logical >= 0 and held.get(key) == it.src:
                    held[key] = it.dst
                    set_last(key, it.dst)
                    owners.get(it.src, set()).discard(key)
                    owners.setdefault(it.dst, set()).add(key)
                where = (f"its hit at logical {it.logical}" if it.logical >= 0
                         else "the cache entry of its state")
                notes.append(f"{it.rid} copies block {it.src} into block {it.dst} "
                             f"(group {it.group}, {where})")
            elif isinstance(it, FreeObs) and it.reason == "copy":
                returns.setdefault((it.rid, it.reason), []).append(f"{it.block}")
            elif isinstance(it, FreeObs):
                key = (it.rid, it.group, it.logical)
                grow(it.rid, it.group, it.logical + 1)
                if held.get(key) == it.block:
                    del held[key]
                    nheld[it.rid] -= 1
                owners.get(it.block, set()).discard(key)
                set_last(key, it.block)
                freed_now.add(key)
                if it.reason == "window":
                    nulled.add(key)
                else:
                    nulled.discard(key)
                returns.setdefault((it.rid, it.reason), []).append(f"{it.block}@{it.logical}")
            elif isinstance(it, StepObs):
                step = it.step
                if r < 0:
                    for rs in it.reqs:
                        for gi, table in enumerate(rs.tables):
                            grow(rs.rid, gi, len(table))
                            tables[(rs.rid, gi)] = table
                    continue
                for rs in it.reqs:
                    for gi, table in enumerate(rs.tables):
                        grow(rs.rid, gi, len(table))
                        for lg, blk in enumerate(table):
                            key = (rs.rid, gi, lg)
                            if blk == NULL and key not in held:
                                nulled.add(key)
            elif isinstance(it, FinishObs) and r < 0:
                ended.add(it.rid)
            elif isinstance(it, ProcessObs) and r >= 0:
                acc = ", ".join(f"{rid} accepted {n}" for rid, n in it.accepted)
                extra = []
                if it.discarded:
                    extra.append("discarded " + ", ".join(it.discarded))
                if it.failed:
                    extra.append("failed load " + ", ".join(f"{rid} from block {k}"
                                                            for rid, k in it.failed))
                tail = (f" ({acc})" if acc else "") + ("; " + "; ".join(extra) if extra else "")
                notes.append(f"output of step {it.step} processed{tail}")
        if r < 0:
            if row.obs.counters is not None:
                counters_seen.update(row.obs.counters.reqs)
            continue
        for (rid, reason), blks in returns.items():
            word = "block" if len(blks) == 1 else "blocks"
            notes.append(f"{rid} returns {word} {', '.join(blks)} ({reason})")
        if step is not None:
            for it in row.obs.items:
                if isinstance(it, StepObs):
                    if not it.reqs:
                        notes.append(f"step {it.step}: nothing scheduled (the engine queues "
                                     f"the empty step)")
                    for rs in it.reqs:
                        spec = f", {rs.spec} draft" if rs.spec else ""
                        load = (f", loads [{rs.start - rs.loaded}, {rs.start})"
                                if rs.loaded else "")
                        notes.append(f"step {it.step}: {rs.rid} computes "
                                     f"[{rs.start}, {rs.end}){spec}{load}")

        # the requests this event may have changed: those it names, those
        # the checker's view of changed, those whose released block someone
        # took or let go of, those with a cell freed in the row before (it
        # reads released now); the first row drawn works out every request
        if r == 0:
            dirty = set(rids)
        else:
            dirty = set(checker._touched) | checker._retired_now | prev_freed
            if isinstance(ev, AddRequest):
                dirty.add(ev.id)
            if row.obs.counters is not None:
                dirty.update(row.obs.counters.reqs)
            for it in row.obs.items:
                if isinstance(it, (AllocObs, FreeObs)):
                    dirty.add(it.rid)
                    dirty.update(k[0] for k in lasts.get(it.block, ()))
                elif isinstance(it, StepObs):
                    dirty.update(rs.rid for rs in it.reqs)
                elif isinstance(it, FinishObs):
                    dirty.add(it.rid)
                elif isinstance(it, ProcessObs):
                    dirty.update(rid for rid, _ in it.accepted)
                    dirty.update(it.discarded)
                    dirty.update(rid for rid, _ in it.failed)
        prev_freed = {k[0] for k in freed_now}

        # the cells after this event (the lanes of the other requests keep theirs)
        snap: dict[tuple[str, int], list[Cell]] = {}
        for rid in dirty:
            for lane in lanes_of.get(rid, ()):
                cells = []
                for lg in range(widths[(lane.rid, lane.group)]):
                    key = (lane.rid, lane.group, lg)
                    if key in held:
                        cells.append(cell("live", held[key]))
                    elif key in freed_now:
                        cells.append(cell("freed", last.get(key)))
                    elif key in last:
                        b = last[key]
                        others = [k for k in owners.get(b, ()) if k != key]
                        if others:
                            cells.append(cell("reused", b, others[0][0]))
                        elif key in nulled:
                            cells.append(cell("null", b))
                        else:
                            cells.append(cell("released", b))
                    elif key in nulled:
                        cells.append(cell("null"))
                    else:
                        cells.append(cell("none"))
                snap[(lane.rid, lane.group)] = cells
        cur.update(snap)
        per_row_cells.append(snap)

        # the unprocessed steps' windows after this event
        pend = {pp.rs.rid for st in checker.pending for pp in st}
        dirty |= pend
        for rid in sorted((rid for rid in pend if rid in rid_pos), key=rid_pos.__getitem__):
            for pp, lo, hi in checker._may_read(rid):
                for gi, g in enumerate(cfg.groups):
                    rb = read_blocks(g, lo, hi, cfg.group_block_size(gi),
                                     checker.prompt_len.get(rid))
                    if len(rb):
                        windows.append(ReadWindow(r, pp.step, rid, gi, rb[0], rb[-1], lo, hi,
                                                  pp.dead))
                        grow(rid, gi, rb[-1] + 1)

        if row.violations and mark is None:
            mark = _locate(row.violations[0], r, row.obs.items, checker, cfg)
            if mark.rid is not None:
                dirty.add(mark.rid)  # the timeline draws it in this row whatever changed

        # counts after this event, of the requests it may have changed
        if row.obs.counters is not None:
            counters_seen.update(row.obs.counters.reqs)
        counts = {}
        for rid in sorted((rid for rid in dirty if rid in rid_pos), key=rid_pos.__getitem__):
            rc = counters_seen.get(rid)
            shadow = sum(pp.end - pp.start for pp in checker._live_pending(rid))
            req = checker.reqs.get(rid)
            f_rep = rc is not None and rc.in_flight is not None
            counts[rid] = ReqCounts(
                p=req.p if req is not None else None,
                f=rc.in_flight if f_rep else shadow,
                c=rc.computed if rc is not None else None,
                f_reported=f_rep,
                status=rc.status if rc is not None else "waiting",
            )
        rows.append(RowInfo(row.index, ev, _fmt_event(ev), step, counts, tuple(notes),
                            len(rids)))

    width = max(widths.values(), default=0)
    # a lane is drawn if a window covers it or a cell of it is not empty (in
    # some row it was worked out in: the others repeat one of those)
    used = {(w.rid, w.group) for w in windows}
    used |= {k for snap in per_row_cells for k, rw in snap.items()
             if k not in used and any(c.state != "none" for c in rw)}
    if mark is not None and mark.rid is not None:
        used.add((mark.rid, mark.group))
    none = Cell("none")
    cells = {}
    for k in used:
        rws, line = [], []
        for snap in per_row_cells:
            line = snap.get(k, line)
            rws.append([*line, *([none] * (width - len(line)))])
        cells[k] = rws
    lanes = [ln for ln in lanes if (ln.rid, ln.group) in used]
    return Grid(cfg, target or res.trace.meta.get("target", "reference"), lanes, rows, cells,
                windows, mark, width, list(res.violations), res.crash,
                res.rows[first].index if first < len(res.rows) else 0, first, list(rids))


def _cell_cache():
    """``Cell(...)``, each distinct cell made once (cells are frozen)."""
    cache: dict[tuple, Cell] = {}

    def cell(*args) -> Cell:
        c = cache.get(args)
        if c is None:
            c = cache[args] = Cell(*args)
        return c

    return cell


def _locate(v: Violation, r: int, items, checker: Checker, cfg: Config) -> Mark:
    """Find the violation's cell: the returned block (property 1) or the
    NULL / foreign block a step reads (property 2)."""
    base = {"row": r, "prop": v.prop, "message": v.message, "rid": v.rid, "block": v.block,
            "step": v.step}
    if v.prop == 1:
        for it in items:
            if isinstance(it, FreeObs) and it.block == v.block and it.rid == v.rid:
                return Mark(**base, group=it.group, logical=it.logical)
    if v.prop == 2 and v.step is not None:
        for step in checker.pending:
            for pp in step:
                if pp.step != v.step or pp.rs.rid != v.rid:
                    continue
                for gi, g in enumerate(cfg.groups):
                    table = pp.rs.tables[gi] if gi < len(pp.rs.tables) else ()
                    for lg in read_blocks(g, pp.start, pp.end, cfg.group_block_size(gi),
                                          checker.prompt_len.get(pp.rs.rid)):
                        blk = table[lg] if lg < len(table) else None
                        if blk is None or blk == NULL or blk == v.block:
                            return Mark(**base, group=gi, logical=lg)
    return Mark(**base)


# --------------------------------------------------------------- the timeline

CELL_W = 6
LEGEND = (
    "legend: p processed  f in flight (f~: the checker's count, the target reports none)  "
    "c optimistic",
    "        7 live block  7* returned during this event  . NULL slot  .>r1 its old block "
    "now held by r1",
    "        - released  >7*< the violating block  [====] logical blocks an unprocessed step "
    "may read",
    "        ([----]: its output is discarded, the kernel still runs)",
)


def _cell_text(c: Cell) -> str:
    if c.state == "live":
        return str(c.block)
    if c.state == "freed":
        return f"{c.block}*"
    if c.state == "null":
        return "."
    if c.state == "reused":
        return f".>{c.by}"
    if c.state == "released":
        return "-"
    return ""


def _lane_lines(grid: Grid, cfg: Config, r: int, rid: str, width: int, lw: int) -> list[str]:
    """One request's block tables at row ``r``, with the unprocessed steps'
    read windows drawn under them."""
    m = grid.mark
    bad = m is not None and m.row == r
    out = []
    for gi, g in enumerate(cfg.groups):
        lane = grid.cells.get((rid, gi))
        cells = lane[r] if lane is not None else []
        wins = grid.windows_at(r, rid, gi)
        marked = bad and m.rid == rid and m.group == gi
        if not wins and not marked and all(c.state in ("none", "released") for c in cells):
            continue
        n = len(cells)
        while n and cells[n - 1].state == "none":
            n -= 1
        n = max([n, *(w.last + 1 for w in wins)])
        shown = min(n, width)
        more = " ..." if n > width else ""
        ind = " " * 15
        out.append(f"{ind}{g.label():<{lw}}" + "".join(f"{lg:^{CELL_W}}" for lg in range(shown)))
        texts = []
        for lg in range(shown):
            t = _cell_text(cells[lg])
            if marked and m.logical == lg:
                t = f">{t or '?'}<"
            texts.append(f"{t:^{CELL_W}}")
        out.append(f"{ind}{'table':<{lw}}" + "".join(texts) + more)
        for w in wins:
            lo = min(w.first, shown)
            hi = min(w.last + 1, shown)
            fill = "-" if w.dead else "="
            bar = " " * (lo * CELL_W)
            if hi > lo:
                bar += "[" + fill * ((hi - lo) * CELL_W - 2) + ("]" if w.last < shown else fill)
            why = " (output discarded)" if w.dead else ""
            pad = " " * max(0, shown * CELL_W - len(bar))
            out.append(f"{ind}{'step ' + str(w.step):<{lw}}{bar}{pad} reads "
                       f"[{w.start}, {w.end}){why}")
    return out


TIMELINE_EVENTS = 200  # the timeline draws the last events up to the violation
PICTURE_EVENTS = 60  # the picture likewise
UNCHANGED_NAMED = 12  # requests named on an event's "unchanged" line


def render_timeline(res: ReplayResult, cfg: Config | None = None, width: int = 24,
                    shown: int | None = TIMELINE_EVENTS) -> str:
    """The terminal story of a replay (see the module docstring). A request
    whose counts, table and windows did not change in an event is listed on
    one ``unchanged`` line. Only the last ``shown`` events up to the first
    violation are drawn (None: all); a line says how many came before."""
    grid = build_grid(res, shown=shown)
    cfg = cfg or grid.config
    lw = max(16, *(len(g.label()) + 2 for g in cfg.groups))
    out = [f"config: {cfg.label()}", *LEGEND]
    if grid.first_index:
        out.append(f"(events #0-#{grid.first_index - 1} replayed and checked, not drawn: "
                   f"the last {len(grid.rows)} events are shown)")
    m = grid.mark
    done: set[str] = set()
    before: dict[str, tuple] = {}
    rids = grid.rids
    for r, info in enumerate(grid.rows):
        bad = m is not None and m.row == r
        head = ">>" if bad else "  "
        sched = f"  -> step {info.step}" if info.step is not None else ""
        if isinstance(info.event, Schedule) and info.step is None:
            sched = "  (nothing scheduled)"
        out.append(f"{head}  #{info.index:<3d} {info.label}{sched}")
        for note in info.notes:
            out.append(f"          {note}")
        # the requests the event may have changed are drawn unless they read as
        # before; every other one reads as before (RowInfo.counts)
        was_done = len(done)
        shown_now: set[str] = set()
        for rid, k in info.counts.items():
            if rid in done:
                continue
            lines = _lane_lines(grid, cfg, r, rid, width, lw)
            state = (k, tuple(lines))
            if before.get(rid) == state and not (bad and m.rid == rid):
                continue
            before[rid] = state
            shown_now.add(rid)
            if k.status == "finished":
                done.add(rid)
            f = f"{k.f}" if k.f_reported else f"{k.f}~"
            p = "-" if k.p is None else k.p
            c = "-" if k.c is None else k.c
            out.append(f"          {rid:<4} {k.status:<9} p={p} f={f} c={c}")
            out.extend(lines)
        n_same = info.nrids - was_done - len(shown_now)
        if n_same > 0:
            same = []  # the first few, in the order requests were added
            for rid in islice(rids, info.nrids):
                if len(same) == UNCHANGED_NAMED:
                    break
                if rid not in shown_now and rid not in done:
                    same.append(rid)
            more = n_same - UNCHANGED_NAMED
            names = ", ".join(same[:UNCHANGED_NAMED]) + (f" and {more} more" if more > 0 else "")
            out.append(f"          (unchanged: {names})")
        if bad:
            for v in res.rows[grid.first_row + r].violations:
                out.append(f">>        VIOLATION {v}")
            if m.logical is not None:
                wu = grid.freed_under_window()
                if wu is not None:
                    out.append(f"          ^ block {m.block} (logical {m.logical} of {m.rid}) "
                               f"went back to the pool while step {wu.step}, unprocessed, may "
                               f"read logical blocks {wu.first}..{wu.last}")
    if res.crash:
        out.append("target crashed:\n" + res.crash)
    if res.first is None and not res.crash:
        out.append(res.held())
    return "\n".join(line.rstrip() for line in out)


# ---------------------------------------------------------------- the picture

COLORS = {
    "none": "#ffffff",
    "live": "#7fb3e6",
    "freed": "#f39c34",
    "null": "#d4d4d4",
    "released": "#ececec",
    "reused": "#b77fd6",
}
STEP_COLORS = ["#1b5e20", "#0d47a1", "#880e4f", "#e65100", "#4a148c", "#006064"]


def _short_event(ev: Event) -> str:
    if isinstance(ev, AddRequest):
        ext = f" ext={ev.external_tokens}" if ev.external_tokens else ""
        return f"AddRequest {ev.id} prompt={ev.prompt_len} new={ev.max_new_tokens}{ext}"
    return _fmt_event(ev)


def render_png(grid: Grid, path: str | Path, max_blocks: int = 40, dpi: int = 110) -> Path:
    """Draw ``grid`` to a PNG (matplotlib's Agg canvas, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lanes = grid.lanes or [Lane("-", 0, "no request")]
    nrows = max(1, len(grid.rows))
    m = grid.mark
    lane_ws = []
    for lane in lanes:  # each panel as wide as its lane needs
        key = (lane.rid, lane.group)
        used = [lg + 1 for rw in grid.cells.get(key, []) for lg, c in enumerate(rw)
                if c.state != "none"]
        used += [w.last + 1 for w in grid.windows if (w.rid, w.group) == key]
        if m is not None and (m.rid, m.group) == key and m.logical is not None:
            used.append(m.logical + 1)
        lane_ws.append(max(1, min(max(used, default=1), max_blocks)))
    panels = [max(1.5, 0.5 * w + 0.3) for w in lane_ws]
    label_w = 3.2
    fig_w = min(80.0, label_w + sum(panels) + 0.3 * len(lanes) + 0.2)
    fig_h = 2.3 + 0.62 * nrows
    fig = Figure(figsize=(fig_w, fig_h), dpi=dpi)
    FigureCanvasAgg(fig)
    left = label_w / fig_w
    fig.subplots_adjust(left=left, right=1 - 0.2 / fig_w, top=1 - 1.15 / fig_h,
                        bottom=0.95 / fig_h, wspace=0.3 * len(lanes) / max(1.0, sum(panels)))
    axes = fig.subplots(1, len(lanes), sharey=True, squeeze=False,
                        gridspec_kw={"width_ratios": panels})[0]
    for ax, lane, W in zip(axes, lanes, lane_ws, strict=True):
        key = (lane.rid, lane.group)
        for r in range(len(grid.rows)):
            line = grid.cells.get(key, [[]] * nrows)[r]
            for lg in range(min(W, len(line))):
                c = line[lg]
                ax.add_patch(Rectangle((lg, r), 1, 1, facecolor=COLORS[c.state],
                                       edgecolor="white", linewidth=1.0))
                if c.block is not None and c.state != "none":
                    txt = str(c.block) if c.state == "live" else f"({c.block})"
                    if c.state == "reused":
                        txt = f"{c.block}→{c.by}"
                    ax.text(lg + 0.5, r + 0.25, txt, ha="center", va="center",
                            fontsize=7 if len(txt) < 5 else 5.5, color="#222222")
        # unprocessed steps' read windows: one bar per step under the block ids,
        # spanning the logical blocks it may read
        for r in range(len(grid.rows)):
            wins = sorted(grid.windows_at(r, lane.rid, lane.group), key=lambda w: w.step)
            h = min(0.16, 0.5 / max(1, len(wins)))
            for k, w in enumerate(wins):
                if w.first >= W:
                    continue
                y = r + 0.46 + k * (h + 0.03)
                color = STEP_COLORS[w.step % len(STEP_COLORS)]
                x1 = min(w.last + 1, W)
                ax.add_patch(Rectangle((w.first + 0.06, y), x1 - w.first - 0.12, h,
                                       facecolor=color, edgecolor=color, alpha=0.45 if w.dead
                                       else 0.9, linestyle="--" if w.dead else "-", zorder=3))
                span = x1 - w.first
                txt = f"step {w.step}" if span >= 2 else f"s{w.step}"
                if w.dead and span >= 3:
                    txt += " (discarded)"
                ax.text(w.first + 0.12, y + h / 2, txt, ha="left", va="center", fontsize=6,
                        color="white", fontweight="bold", zorder=4)
        if m is not None and m.rid == lane.rid and m.group == lane.group \
                and m.logical is not None and m.logical < W:
            ax.add_patch(Rectangle((m.logical + 0.03, m.row + 0.03), 0.94, 0.94, fill=False,
                                   edgecolor="#d50000", linewidth=3.0, zorder=5))
        ax.set_xlim(0, W)
        ax.set_ylim(nrows, 0)
        step = 1 if W <= 24 else 2 if W <= 48 else 4
        ax.set_xticks([x + 0.5 for x in range(0, W, step)])
        ax.set_xticklabels([str(x) for x in range(0, W, step)], fontsize=7)
        ax.set_xlabel("logical block", fontsize=8)
        ax.set_title(lane.label.replace(" · ", "\n"), fontsize=8)
        ax.tick_params(axis="y", length=0)
        for s in ("top", "right"):
            ax.spines[s].set_visible(False)
    ax0 = axes[0]
    ax0.set_yticks([r + 0.5 for r in range(len(grid.rows))])
    labels = []
    for info in grid.rows:
        lab = f"#{info.index} {_short_event(info.event)}"
        if info.step is not None:
            lab += f" → step {info.step}"
        if len(lab) > 48:
            lab = lab[:47] + "…"
        labels.append(lab)
    ax0.set_yticklabels(labels, fontsize=7)
    if m is not None and m.row < len(ax0.get_yticklabels()):
        t = ax0.get_yticklabels()[m.row]
        t.set_color("#d50000")
        t.set_fontweight("bold")
    title = f"{grid.target}: {grid.config.label()}"
    if m is not None:
        msg = f"VIOLATION property {m.prop}: {m.message}"
        wu = grid.freed_under_window()
        if wu is not None:
            msg = (f"block {m.block} ({m.rid}, logical {m.logical}) went back to the pool at "
                   f"event #{grid.rows[m.row].index} while step {wu.step}, unprocessed, may read "
                   f"logical blocks {wu.first}..{wu.last} (red box).  " + msg)
    elif grid.crash:
        msg = "target crashed"
    else:
        msg = "all properties hold"
    wrap = max(60, int(fig_w * 15))
    fig.suptitle(title + "\n" + "\n".join(textwrap.wrap(msg, wrap)[:3]), fontsize=8,
                 x=0.01, ha="left", y=0.995, va="top")
    handles = [Patch(facecolor=COLORS[s], edgecolor="#999999", label=s) for s in
               ("live", "freed", "null", "reused", "released")]
    handles.append(Patch(facecolor=STEP_COLORS[0], edgecolor=STEP_COLORS[0],
                         label="logical blocks an unprocessed step may read"))
    handles.append(Line2D([], [], color="#d50000", linewidth=3, label="violation"))
    fig.legend(handles=handles, loc="lower left", fontsize=7,
               ncol=min(len(handles), max(2, int(fig_w / 1.9))),
               frameon=False, bbox_to_anchor=(0.01, 0.0))
    fig.savefig(path, dpi=dpi)
    return path


# ------------------------------------------------------------- the reproducer

_REPRO = '''\
"""Reproducer for a kvcheck counterexample (standalone pytest file).

{violation}

It replays the trace below on the target named by $KVCHECK_TARGET (default
{target!r}, where it was found) and asserts that every property holds, so it
FAILS on the buggy target and PASSES once the freeing logic is fixed:

    pytest {fname}
    KVCHECK_TARGET=vllm@0.33.0 pytest {fname}
    KVCHECK_POLICY=settled pytest {fname}    # reference target, another policy

It imports kvcheck from $KVCHECK_ROOT, default {root!r}.
"""

import json
import os
import sys
from dataclasses import replace

KVCHECK_ROOT = os.environ.get("KVCHECK_ROOT", {root!r})
TRACE_TARGET = {target!r}
TRACE_JSON = {trace_literal}


def _kvcheck():
    if not os.path.isdir(os.path.join(KVCHECK_ROOT, "properties")):
        raise AssertionError(f"kvcheck not found at {{KVCHECK_ROOT!r}}: set KVCHECK_ROOT")
    if KVCHECK_ROOT not in sys.path:
        sys.path.insert(0, KVCHECK_ROOT)
    from impl.target import make_target
    from model.events import Trace
    from properties.replay import InvalidEvent, format_timeline, replay

    return make_target, Trace, InvalidEvent, format_timeline, replay


def {func}():
    make_target, Trace, InvalidEvent, format_timeline, replay = _kvcheck()
    trace = Trace.from_json(json.loads(TRACE_JSON))
    spec = os.environ.get("KVCHECK_TARGET") or TRACE_TARGET
    target = make_target(spec)
    policy = target.capabilities.fixed_policy or os.environ.get("KVCHECK_POLICY")
    if policy:
        trace = Trace(replace(trace.config, policy=policy), trace.events, trace.meta)
    try:
        res = replay(trace, target)
    except InvalidEvent as e:
        raise AssertionError(f"the trace does not apply to {{spec}}: {{e}}") from None
    if res.crash is not None:
        raise AssertionError(f"target {{spec}} crashed:\\n{{res.crash}}")
    if res.first is not None:
        raise AssertionError(f"on {{spec}} (policy {{trace.config.policy}}): {{res.first}}"
                             "\\n\\n" + format_timeline(res))
'''


def _identifier(name: str) -> str:
    s = re.sub(r"\W+", "_", name).strip("_").lower()
    return s if s and not s[0].isdigit() else f"t_{s}"


def reproducer_source(trace: Trace, target: str, name: str,
                      repo_root: str | Path | None = None, fname: str | None = None) -> str:
    text = trace.dumps()
    lit = 'r"""\n' + text + '"""' if '"""' not in text and "\\" not in text else repr(text)
    violation = trace.meta.get("violation") or "(no violation recorded with the trace)"
    violation = "\n".join(textwrap.wrap(f"Found on {target}: {violation}", 76))
    return _REPRO.format(violation=violation, target=target, fname=fname or f"test_{name}.py",
                         root=str(Path(repo_root or REPO_ROOT).resolve()), trace_literal=lit,
                         func=f"test_{_identifier(name)}")


def write_reproducer(trace: Trace, path: str | Path, target: str | None = None,
                     repo_root: str | Path | None = None) -> Path:
    """Write a standalone pytest file replaying ``trace`` (see the module doc);
    never over an existing file (``FileExistsError``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = target or trace.meta.get("target") or "reference"
    name = path.stem[5:] if path.stem.startswith("test_") else path.stem
    with open(path, "x") as f:
        f.write(reproducer_source(trace, target, name, repo_root, path.name))
    return path


@dataclass
class ReportPaths:
    png: Path | None
    reproducer: Path | None
    errors: list[str] = field(default_factory=list)
    trace: Path | None = None


def with_violation(trace: Trace, res: ReplayResult) -> Trace:
    """``trace`` with ``meta.violation`` set to what a replay of that very
    trace reports (``res``), so the message names the requests and blocks of
    the trace as saved, after shrinking and renaming."""
    meta = dict(trace.meta)
    if res.first is not None:
        meta["violation"] = str(res.first)
    elif res.crash is not None:
        meta["violation"] = "target crash: " + res.crash.strip().splitlines()[0][:200]
    elif "violation" in meta:
        meta["violation"] = f"{meta['violation']} (a replay of this trace did not reproduce it)"
    return Trace(trace.config, trace.events, meta)


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


def _temp(out: Path, suffix: str, data: bytes | None = None) -> Path:
    fd, name = tempfile.mkstemp(dir=out, prefix=".kvcheck-", suffix=suffix)
    os.fchmod(fd, 0o666 & ~_umask())  # as an ordinary new file, not mkstemp's 0600
    with os.fdopen(fd, "wb") as f:
        if data is not None:
            f.write(data)
    return Path(name)


def _place(tmp: Path, final: Path) -> None:
    """Give the finished file ``tmp`` the name ``final`` unless that name is
    taken (``FileExistsError``): a hard link is atomic and never replaces; a
    file system without links gets an exclusive create and a copy."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS,
                           errno.EXDEV, errno.EMLINK):
            raise
        with open(final, "xb") as f:
            f.write(tmp.read_bytes())


FILES = ("json", "png", "py")


def _file_names(stem: str) -> dict[str, str]:
    return {"json": f"{stem}.json", "png": f"{stem}.png", "py": f"test_{_identifier(stem)}.py"}


def _write_group(res: ReplayResult, out: str | Path, name: str, target: str | None,
                 trace: Trace, want: tuple[str, ...], reserve: tuple[str, ...],
                 grid: Grid | None = None) -> ReportPaths:
    """Write the files ``want`` (of ``json``, ``png``, ``py``) together under
    the first name ``NAME``, ``NAME-1``, ... for which none of the files
    ``reserve`` exists. Each is written to a temporary file in ``out`` first
    and then linked to its name, so no file is ever overwritten and none is
    seen half written; a name another writer takes meanwhile is given back
    and the next one tried."""
    out = Path(out)
    target = target or trace.meta.get("target") or "reference"
    paths = ReportPaths(None, None)
    out.mkdir(parents=True, exist_ok=True)
    temps: dict[str, Path] = {}
    try:
        if "json" in want:
            temps["json"] = _temp(out, ".json", trace.dumps().encode())
        if "png" in want:
            tmp = temps["png"] = _temp(out, ".png")
            try:
                render_png(grid if grid is not None else build_grid(res, target, PICTURE_EVENTS),
                           tmp)
            except Exception as e:  # noqa: BLE001 - a report must never hide the verdict
                paths.errors.append(f"picture not written: {type(e).__name__}: {e}")
                del temps["png"]
                tmp.unlink(missing_ok=True)
        for n in range(100_000):
            stem = name if n == 0 else f"{name}-{n}"
            names = _file_names(stem)
            if any((out / names[k]).exists() for k in reserve):
                continue
            if "py" in want:
                if "py" in temps:
                    temps.pop("py").unlink(missing_ok=True)
                src = reproducer_source(trace, target, stem, None, names["py"])
                # an id no encoding can write (a lone surrogate) stays an escape
                temps["py"] = _temp(out, ".py", src.encode("utf-8", "backslashreplace"))
            placed: list[Path] = []
            try:
                for k in FILES:
                    if k in temps:
                        _place(temps[k], out / names[k])
                        placed.append(out / names[k])
            except FileExistsError:  # another writer took the name meanwhile
                for q in placed:
                    q.unlink(missing_ok=True)
                continue
            paths.trace = out / names["json"] if "json" in temps else None
            paths.png = out / names["png"] if "png" in temps else None
            paths.reproducer = out / names["py"] if "py" in temps else None
            return paths
        raise FileExistsError(f"no free name for {name!r} in {out}")
    finally:
        for t in temps.values():
            t.unlink(missing_ok=True)


def save_counterexample(res: ReplayResult, out: str | Path, name: str,
                        target: str | None = None, report: bool = True) -> ReportPaths:
    """A counterexample's trace ``<out>/NAME.json`` and, with ``report``, its
    picture ``NAME.png`` and reproducer ``test_NAME.py``, written together
    under one fresh ``NAME`` (``name``, else ``name-1``, ...: none of the three
    may exist). The trace saved is ``res.trace`` with ``meta.violation`` taken
    from ``res`` (a replay of that trace). ``OSError`` if the trace cannot be
    written; a picture that cannot be drawn is listed in ``errors``."""
    trace = with_violation(res.trace, res)
    note = layout_note(target or trace.meta.get("target") or "reference", trace.config)
    if note:
        trace = Trace(trace.config, trace.events, {**trace.meta, "layout": note})
    want = FILES if report else ("json",)
    return _write_group(res, out, name, target, trace, want, FILES)


def write_report(res: ReplayResult, out: str | Path, name: str, target: str | None = None,
                 png: bool = True, reproducer: bool = True,
                 grid: Grid | None = None) -> ReportPaths:
    """``<out>/<name>.png`` and ``<out>/test_<name>.py`` for a replay, under
    ``name-1``, ... where either exists (never over a file). Errors drawing
    or writing are collected, never raised: the trace is what matters.
    ``grid``: the picture's grid drawn already (:func:`replay_shown_job`)."""
    trace = with_violation(res.trace, res) if res.first is not None else res.trace
    want = tuple(k for k, on in (("png", png), ("py", reproducer)) if on)
    try:
        return _write_group(res, out, name, target, trace, want, want, grid)
    except OSError as e:
        return ReportPaths(None, None, [f"report not written in {out}: {e}"])


def replay_shown_job(trace: Trace, target: str, props: frozenset[int] | None = None
                     ) -> tuple[ReplayResult, str, Grid | None]:
    """A replay and what ``./kvcheck replay`` shows of it, made in the worker
    beside the target: the timeline, and after a violation the picture's
    grid. The result comes back without its rows (one per event, with every
    observation: a long trace's rows would cost more to send than to replay)."""
    from properties.replay import replay

    res = replay(trace, target, props=props)
    text = render_timeline(res)
    grid = build_grid(res, target, PICTURE_EVENTS) if res.first is not None else None
    res.rows = []
    return res, text, grid


__all__ = [
    "STATES", "Cell", "Grid", "Lane", "Mark", "ReadWindow", "ReportPaths", "RowInfo",
    "build_grid", "render_png", "render_timeline", "replay_shown_job", "reproducer_source",
    "save_counterexample",
    "with_violation", "write_reproducer", "write_report",
]
