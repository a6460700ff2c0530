"""Time where the change is: which rows execute the lines that differ from
the base.

Before the rows run, the gate probes the matrix briefly with line tracing of
the changed files on (``sys.settrace``, in the target's worker, only for the
probe): one probe per kind x hazard x failed loads, the widest row of that
group (depth 2, drafts, prefix caching where the kind takes it). Rows of a
group whose probe executed a changed line run first and get a larger share
of the budget. The probes take at most a tenth of the budget; what no probe
reached is listed (what the gate did not see).

A probe's share can be shorter than its kind's first scheduler build (an
encoder-decoder's takes seconds): the changed lines are also read as code,
and a line inside a manager class of ``single_type_kv_cache_manager.py``
marks the kinds that class (or one that inherits it) manages
(:func:`kinds_of_changes`), whether or not their probe got that far. Those
rows run after the rows whose probe executed a changed line and before the
others, with :data:`WEIGHT` shares each: reading marks every kind whose
manager inherits the changed method (a slip in full attention's hit on a
partial entry marks six kinds), where the probe sees the one or two rows
that reach that branch, and those keep the larger part of the budget.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gate.base import Changes

PROBE_SHARE = 0.1  # of the budget, at most
WEIGHT = 3.0  # a row that executes changed lines gets at least this many shares
HIT_SHARE = 0.5  # ... and those rows together at least this part of the budget


MANAGERS = "vllm/v1/core/single_type_kv_cache_manager.py"
ROOT_MANAGER = "SingleTypeKVCacheManager"  # the class every manager there inherits


def kinds_of_changes(changes: Changes, tree: Path) -> set[str]:
    """The kinds whose vLLM manager class holds a changed line of
    :data:`MANAGERS` under ``tree``, or inherits the class that does, or
    lies beside attention that does (ring, cross), and ``hybrid`` with any
    of its groups' kinds. A change to the common base class marks
    every kind, as does one that cannot be read."""
    import ast

    from model.kinds import KINDS

    lines = changes.files.get(MANAGERS)
    if not lines:
        return set()
    try:
        mod = ast.parse((tree / MANAGERS).read_text())
    except (OSError, SyntaxError, ValueError):
        return {*KINDS, "hybrid"}
    classes = [n for n in mod.body if isinstance(n, ast.ClassDef)]
    parents = {c.name: [b.id for b in c.bases if isinstance(b, ast.Name)] for c in classes}
    changed = {c.name for c in classes
               if any(c.lineno <= n <= (c.end_lineno or c.lineno) for n in lines)}

    def inherits(name: str, seen: frozenset = frozenset()) -> bool:
        if name in changed:
            return True
        # a manager the file does not define is taken as the common base's
        up = parents.get(name, [] if name == ROOT_MANAGER else [ROOT_MANAGER])
        return any(inherits(p, seen | {name}) for p in up if p not in seen)

    out = {k for k, kind in KINDS.items()
           if inherits(kind.vllm_manager)
           or (kind.beside and inherits(KINDS[kind.beside].vllm_manager))}
    if out & {"full", "sliding", "chunked_local", "mamba"}:  # what hybrids are made of
        out.add("hybrid")
    return out


def _group(row: dict) -> tuple:
    k = row.get("knobs") or {}
    return (row["kind"], k.get("hazard"), bool(k.get("failed_loads")), k.get("drafter"),
            k.get("block_sizes"), k.get("match_unit"))


def _widest(rows: list[dict]) -> dict:
    def score(r: dict) -> tuple:
        k = r.get("knobs") or {}
        return (k.get("depth") == 2, bool(k.get("spec_tokens")), bool(k.get("prefix_caching")))

    return max(rows, key=score)


def probe_job(spec: Any, files: dict[str, list[int]], tree: str, seconds: float,
              seed: int | None = None) -> dict[str, list[int]]:
    """In a worker beside the target: fuzz ``spec`` for ``seconds`` with the
    lines ``files`` (``vllm/REL`` -> line numbers, under ``tree``) traced, or
    until every one of them has run; the lines executed, per file."""
    import os
    import tempfile

    from properties.jobs import fuzz_job

    root = Path(tree)
    watched: dict[str, tuple[str, set[int]]] = {}
    for rel, lines in files.items():
        for p in {str(root / rel), str((root / rel).resolve())}:
            watched[p] = (rel, set(lines))
    hits: dict[str, set[int]] = {rel: set() for rel in files}
    left = [sum(len(set(v)) for v in files.values())]
    fd, stop = tempfile.mkstemp(prefix="kvcheck-probe-")
    os.close(fd)
    os.unlink(stop)  # created once every changed line has run: the probe ends

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            rel, lines = watched[frame.f_code.co_filename]
            if frame.f_lineno in lines and frame.f_lineno not in hits[rel]:
                hits[rel].add(frame.f_lineno)
                left[0] -= 1
                if left[0] == 0:
                    open(stop, "w").close()
        return local

    def global_(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename in watched:
            # a changed ``def`` line ran when its module was imported: it
            # counts as reached when its function is called
            rel, lines = watched[frame.f_code.co_filename]
            first = frame.f_code.co_firstlineno
            if first in lines and first not in hits[rel]:
                hits[rel].add(first)
                left[0] -= 1
                if left[0] == 0:
                    open(stop, "w").close()
            return local
        return None

    old = sys.gettrace()
    sys.settrace(global_)
    threading.settrace(global_)
    try:
        # a failure is not shrunk (the probe wants the lines, the row its
        # counterexample) and the probe goes on with the next seed
        end, n = time.monotonic() + seconds, 0
        while left[0] and time.monotonic() < end - 0.2:
            fuzz_job(spec, 10**7, None if seed is None else seed + n, None,
                     end - time.monotonic(), 0, False, stop, 0.1)
            n += 1
    finally:
        sys.settrace(old)
        threading.settrace(None)  # type: ignore[arg-type]
        if os.path.exists(stop):
            os.unlink(stop)
    return {rel: sorted(v) for rel, v in hits.items()}


@dataclass
class Probe:
    executed: dict[str, set[int]] = field(default_factory=dict)
    groups_hit: set[tuple] = field(default_factory=set)  # their probe executed a changed line
    probes: int = 0
    seconds: float = 0.0
    kinds_read: set[str] = field(default_factory=set)  # marked by kinds_of_changes
    groups_read: set[tuple] = field(default_factory=set)  # of those kinds, not in groups_hit

    def count(self) -> int:
        return sum(len(v) for v in self.executed.values())

    def missed(self, changes: Changes) -> list[str]:
        """``file:lines`` ranges no probe executed."""
        out = []
        for rel, lines in sorted(changes.files.items()):
            rest = [n for n in lines if n not in self.executed.get(rel, set())]
            i = 0
            while i < len(rest):
                j = i
                while j + 1 < len(rest) and rest[j + 1] == rest[j] + 1:
                    j += 1
                out.append(f"{rel}:{rest[i]}" + (f"-{rest[j]}" if j > i else ""))
                i = j + 1
        return out

    def text(self, changes: Changes) -> str:
        read = (f"; in the managers of {', '.join(sorted(self.kinds_read))}"
                if self.kinds_read else "")
        ran = f"; executed in {len(self.groups_hit)} row group(s)" if self.groups_hit else ""
        return (f"changed lines executed: {self.count()} of {changes.lines} "
                f"({self.probes} probes, {self.seconds:.0f} s{ran}{read}; their rows run first)")


def probe(rows: list[dict], changes: Changes, target: str, tree: Path, budget: float,
          workers: int, seed: int | None = None) -> Probe:
    """Probe one row of each group for its share of :data:`PROBE_SHARE` of
    the budget, ``workers`` at once."""
    from dataclasses import replace

    from gate.matrix import spec_of
    from impl.target import fit_spec, make_target
    from properties.jobs import _call

    t0 = time.monotonic()
    out = Probe()
    if not changes.files:
        return out
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_group(r), []).append(r)
    plan = [(g, _widest(rs)) for g, rs in groups.items()]
    each = max(0.5, PROBE_SHARE * budget * workers / max(1, len(plan)) - 0.5)
    caps = make_target(target).capabilities
    lock = threading.Lock()
    todo = list(plan)

    def loop(slot: int) -> None:
        while True:
            with lock:
                if not todo:
                    return
                g, row = todo.pop(0)
            spec = replace(spec_of(row))
            try:
                fit_spec(target, caps, spec)
                got = _call(target, slot, "gate.coverage:probe_job",
                            (spec, changes.files, str(tree), each, seed))
            except Exception:  # noqa: BLE001 - a probe that fails says nothing; its row runs
                continue
            with lock:
                out.probes += 1
                for rel, lines in got.items():
                    out.executed.setdefault(rel, set()).update(lines)
                    if lines:
                        out.groups_hit.add(g)

    threads = [threading.Thread(target=loop, args=(s,), daemon=True) for s in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out.kinds_read = kinds_of_changes(changes, tree)
    out.groups_read = {g for g in groups if g[0] in out.kinds_read} - out.groups_hit
    out.seconds = time.monotonic() - t0
    return out


def prioritize(rows: list[dict], p: Probe) -> list[dict]:
    """Rows whose group executed a changed line first, then the rows of the
    kinds only reading marked (:data:`WEIGHT` shares each), the others after
    them (stable order), one share each. A row that executes changed lines
    gets :data:`WEIGHT` shares, or more where few rows do: together they get
    at least :data:`HIT_SHARE` of the budget (a change only a feature row
    reaches gets its time there, not a 250th of it)."""
    if not p.groups_hit and not p.groups_read:
        return rows
    hit = [r for r in rows if _group(r) in p.groups_hit]
    read = [r for r in rows if _group(r) in p.groups_read and _group(r) not in p.groups_hit]
    rest = [r for r in rows if _group(r) not in p.groups_hit | p.groups_read]
    weight = hit_weight(len(hit), len(rest) + WEIGHT * len(read))
    return ([{**r, "weight": weight, "executes_changes": True} for r in hit]
            + [{**r, "weight": WEIGHT, "executes_changes": True} for r in read] + rest)


def hit_weight(hit: int, rest: float) -> float:
    """The shares of each of ``hit`` rows beside ``rest`` shares of the others."""
    if not hit:
        return WEIGHT
    return max(WEIGHT, HIT_SHARE / (1 - HIT_SHARE) * rest / hit)
