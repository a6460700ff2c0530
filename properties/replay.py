"""Replay a trace on a target, check it, and tell the story as a timeline.

The timeline is written for a reviewer at 2 a.m.: one block of lines per
event; for each scheduled step the requests' intervals and block tables
(``.`` NULL, ``*`` returned during this event, ``[n]`` blocks the step reads);
each request's processed / in-flight / optimistic counts; the violation marked
with ``>>``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

from impl.target import Target, TargetCrash, make_target
from model.events import Config, Event, Trace
from model.observations import NULL, FreeObs, Observed, ProcessObs, StepObs
from model.windows import read_blocks
from properties.invariants import Checker, Violation


@dataclass
class Row:
    index: int
    event: Event
    obs: Observed
    violations: list[Violation]
    settled: dict[str, int | None] = field(default_factory=dict)


@dataclass
class ReplayResult:
    trace: Trace
    rows: list[Row]
    violations: list[Violation]
    witness: dict[str, int]
    crash: str | None = None

    @property
    def first(self) -> Violation | None:
        return self.violations[0] if self.violations else None


def replay(trace: Trace, target: Target | str = "reference", stop_at_first: bool = True,
           ) -> ReplayResult:
    tgt = make_target(target) if isinstance(target, str) else target
    checker = Checker(trace.config)
    checker.feed(None, tgt.reset(trace.config))
    rows: list[Row] = []
    crash = None
    for i, ev in enumerate(trace.events):
        try:
            obs = tgt.apply(ev)
        except TargetCrash as e:
            crash = str(e)
            break
        except ValueError as e:
            # the target refused the event: the trace is not valid for it
            raise InvalidEvent(f"event {i} ({type(ev).__name__}) is not valid here: {e}") from None
        except Exception:  # noqa: BLE001
            crash = f"{tgt.name} raised on event {i} ({ev}):\n{traceback.format_exc()}"
            break
        vs = checker.feed(ev, obs)
        rows.append(Row(i, ev, obs, vs, {r: q.p for r, q in checker.reqs.items()}))
        if vs and stop_at_first:
            break
    return ReplayResult(trace, rows, list(checker.violations), dict(checker.witness), crash)


class InvalidEvent(ValueError):
    """A trace event the target refuses as invalid in its state (exit 2)."""


def _fmt_event(ev: Event) -> str:
    name = type(ev).__name__
    args = {k: v for k, v in vars(ev).items()} if hasattr(ev, "__dict__") else {}
    if not args:
        return f"{name}()"
    inner = ", ".join(f"{k}={v!r}" if k != "id" else repr(v) for k, v in args.items()
                      if not (k in ("external_tokens", "accepted") and not v))
    return f"{name}({inner})"


def format_timeline(res: ReplayResult, cfg: Config | None = None, width: int = 24) -> str:
    cfg = cfg or res.trace.config
    B = cfg.block_size
    out = [f"config: {cfg.label()}"]
    bad = res.first
    step_of: dict[int, int] = {}
    for row in res.rows:
        mark = ">>" if row.violations else "  "
        out.append(f"{mark} {row.index:3d}  {_fmt_event(row.event)}")
        freed = [it for it in row.obs.items if isinstance(it, FreeObs)]
        for it in row.obs.items:
            if isinstance(it, ProcessObs):
                acc = ", ".join(f"{r} accepted {n}" for r, n in it.accepted)
                extra = []
                if it.discarded:
                    extra.append("discarded " + ",".join(it.discarded))
                if it.failed:
                    extra.append("failed load " + ",".join(f"{r}@block {k}" for r, k in it.failed))
                tail = (f" ({acc})" if acc else "") + ("; " + "; ".join(extra) if extra else "")
                out.append(f"         output of step {it.step} processed{tail}")
        if freed:
            by = {}
            for f in freed:
                by.setdefault((f.rid, f.reason), []).append(f"{f.block}@{f.logical}")
            for (rid, reason), blks in by.items():
                out.append(f"         {rid} returns blocks {', '.join(blks)} ({reason})")
        for it in row.obs.items:
            if isinstance(it, StepObs):
                step_of[it.step] = row.index
                for rs in it.reqs:
                    counters = row.obs.counters.reqs.get(rs.rid) if row.obs.counters else None
                    c = counters.computed if counters else "?"
                    f = counters.in_flight if counters and counters.in_flight is not None else "-"
                    p = row.settled.get(rs.rid)
                    spec = f", {rs.spec} draft" if rs.spec else ""
                    load = f", loads [{rs.start - rs.loaded}, {rs.start})" if rs.loaded else ""
                    out.append(f"         step {it.step}: {rs.rid} computes [{rs.start}, {rs.end})"
                               f"{spec}{load}   p={p} f={f} c={c}")
                    freed_now = {f.block for f in freed if f.rid == rs.rid}
                    for gi, table in enumerate(rs.tables):
                        g = cfg.groups[gi]
                        reads = set(read_blocks(g, rs.start, rs.end, B))
                        cells = []
                        for lg, blk in enumerate(table[:width]):
                            s = "." if blk == NULL else str(blk)
                            if blk in freed_now:
                                s += "*"
                            cells.append(f"[{s}]" if lg in reads else f" {s} ")
                        more = " ..." if len(table) > width else ""
                        out.append(f"           {g.label():<18} {' '.join(cells)}{more}")
        for v in row.violations:
            out.append(f">>       VIOLATION {v}")
    if res.crash:
        out.append("target crashed:\n" + res.crash)
    if bad is None and not res.crash:
        out.append("all properties hold")
    return "\n".join(out)
