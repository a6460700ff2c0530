"""Known findings: the one home that fuzz, replay, the gate and the nightly
ask whether a counterexample is a bug already on file.

A finding is a trace in a finding's folder, ``findings/NN-NAME/*.json``
(:func:`finding_traces`), with ``meta.finding`` (its number, ``NN``),
``meta.title``, ``meta.upstream``, the property and text it ends in
(``meta.expect``, or a crash's ``meta.crash``), and the fix that clears it
(``meta.fixed_by``, a diff against ``meta.target``'s release).

A counterexample is a finding by shape (:func:`classify`) when it shows the
finding's property and text and holds the finding's event types, kinds,
drafter and load-failure policy. It is a finding by fix (:func:`classify_by_fix`)
when it fails on the finding's release and holds once that finding's fix is
applied: this covers the other kinds and the other properties a bug's traces
can end in (finding 3's failed load seen as a stalled request, property 7).
The list only *names* a counterexample; whether it fails a gate is decided by
replaying it on the base (:mod:`gate.attribution`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FINDINGS = ROOT / "findings"
FIX_START_S = 20.0  # about what starting a worker on a fix's tree takes (2 cores)
REPLAY_S = 2.0  # a counterexample's replay in a worker already started


@dataclass(frozen=True)
class Finding:
    name: str
    prop: int | None  # None: a crash
    text: str
    events: frozenset[str]
    kinds: frozenset[str]
    drafter: str
    load_failure: str = "recompute"  # Config.kv_load_failure_policy of its trace
    target: str = ""  # the release it was found on (meta.target)
    fixed_by: str | None = None  # its fix, a diff for that release (meta.fixed_by)
    number: int | None = None  # meta.finding
    title: str = ""
    upstream: str = ""
    path: Path | None = None

    def says(self, message: str) -> bool:
        """Whether ``message`` carries this finding's text; in a crash's text
        each number stands for any number ("Cannot get 1 free blocks from the
        pool" says "Cannot get 3 free blocks from the pool"). A violation's
        text is matched as it is: its numbers name steps and requests."""
        if self.prop is not None:
            return self.text in message
        rx = re.sub(r"\d+", r"\\d+", re.escape(self.text))
        return re.search(rx, message) is not None

    @property
    def label(self) -> str:
        """``finding 5, Mamba align load admitted one block short (upstream
        PR #46892 (open))``: how every command names it."""
        if self.number is None:
            return self.name
        up = f" (upstream {self.upstream})" if self.upstream else ""
        return f"finding {self.number}, {self.title or self.name}{up}"


def finding_traces(folder: Path = FINDINGS) -> list[Path]:
    """Every trace of the vLLM findings: ``findings/NN-NAME/*.json``, in
    order of the findings' numbers (SGLang's are under ``findings/sglang/``)."""
    return sorted(folder.glob("[0-9][0-9]-*/*.json"))


def trace_path(stem: str, folder: Path = FINDINGS) -> Path:
    """The trace of a finding by its name (the file's stem)."""
    hit = [p for p in finding_traces(folder) if p.stem == stem]
    if not hit:
        raise FileNotFoundError(f"no finding trace named {stem} under {folder}")
    return hit[0]


def with_fix(target: str, fix: str | None) -> str:
    """``target`` with a finding's fix applied: ``fix`` is a diff or a series
    (``A.diff+B.diff``) of paths relative to the repository, as ``meta.target``
    and ``meta.fixed_by`` name them; each is made absolute, so the target runs
    from any folder."""
    from impl.vllm.overlay import series

    if not fix:
        return target
    return "+".join([target, *(str(ROOT / d) for d in series(fix))])


def in_repo(target: str) -> str:
    """A target named in a trace's meta (``vllm@R+findings/...diff``) with its
    diffs' paths made absolute."""
    engine, _, rest = target.partition("@")
    release, plus, fix = rest.partition("+")
    return with_fix(f"{engine}@{release}", fix) if plus else target


def fix_files(fix: str | None) -> list[Path]:
    """The diff files of a fix or a series of fixes."""
    from impl.vllm.overlay import series

    return [ROOT / d for d in series(fix)] if fix else []


def known_findings(folder: Path = FINDINGS) -> list[Finding]:
    """The findings on releases (a trace whose ``meta.target`` is a release
    with a fix applied is a counterexample to that fix, not a finding)."""
    from model.events import Trace

    out = []
    for path in finding_traces(folder):
        t = Trace.load(path)
        m = t.meta
        if "+" in str(m.get("target", "")):
            continue
        crash = "crash" in m
        out.append(Finding(path.stem, None if crash else int(m.get("prop", 2)),
                           m["crash"] if crash else m["expect"],
                           frozenset(type(e).__name__ for e in t.events),
                           frozenset(g.kind for g in t.config.groups), t.config.drafter,
                           t.config.kv_load_failure_policy, str(m.get("target", "")),
                           m.get("fixed_by"), m.get("finding"), str(m.get("title", "")),
                           str(m.get("upstream", "")), path))
    return out


def by_name(name: str | None, findings: list[Finding] | None = None) -> Finding | None:
    return next((f for f in (findings or known_findings()) if f.name == name), None)


def _signature_matches(res: Any, findings: list[Finding]) -> list[Finding]:
    """The findings whose property (or crash) and text the result shows."""
    out = []
    for f in findings:
        if res.crash is not None:
            if f.prop is None and f.says(res.crash):
                out.append(f)
        elif res.violation is not None and f.prop == res.violation.prop \
                and f.says(res.violation.message):
            out.append(f)
    return out


def _shape(res: Any) -> tuple[set[str], set[str], str, str]:
    trace = res.trace
    # a crash while the scheduler is built has no events (and no trace)
    events = {type(e).__name__ for e in trace.events} if trace else set()
    kinds = {g.kind for g in trace.config.groups} if trace else {res.spec.kind}
    drafter = trace.config.drafter if trace else res.spec.drafter
    load_failure = trace.config.kv_load_failure_policy if trace else res.spec.load_failure
    return events, kinds, drafter, load_failure


def classify(res: Any, findings: list[Finding]) -> str | None:
    """The known finding a fuzz result's counterexample is by its shape, or None."""
    if res.trace is None and res.crash is None:
        return None
    events, kinds, drafter, load_failure = _shape(res)
    matches = [f for f in _signature_matches(res, findings)
               if f.events <= events and f.kinds <= kinds and f.drafter == drafter
               and f.load_failure == load_failure]
    # the most specific finding: the one whose trace needs the most event types
    return max(matches, key=lambda f: (len(f.events), len(f.kinds))).name if matches else None


def fix_candidates(res: Any, findings: list[Finding], release: str,
                   any_text: bool = False) -> list[Finding]:
    """The findings of ``release`` whose fix may clear the counterexample:
    those with its property and text, and (``any_text``) also every finding
    whose trace needs no event type the counterexample lacks and whose
    load-failure policy it shares (a bug seen through another property).
    One per fix, the likeliest first (each new fix costs a worker's start,
    and naming has a deadline): a finding on the counterexample's kinds and
    drafter, then one with its text, then the one needing the most of its
    event types (finding 11's text, "scheduled nothing", is every stall's)."""
    if res.trace is None:
        return []
    events, kinds, drafter, load_failure = _shape(res)
    said = _signature_matches(res, findings)
    rest = [f for f in findings if any_text and f not in said and f.events <= events
            and f.load_failure == load_failure]

    def likeliest(f: Finding) -> tuple:
        return (not f.kinds <= kinds, f.drafter != drafter, f not in said, -len(f.events),
                f.name)

    out, fixes = [], set()
    for f in sorted([*said, *rest], key=likeliest):
        if f.target != release or not f.fixed_by or f.fixed_by in fixes:
            continue
        fixes.add(f.fixed_by)
        # findings 1-3 share one fix: it is named by the one with the text
        out.append(next((g for g in said if g.fixed_by == f.fixed_by
                         and g.target == release), f))
    return out


def classify_by_fix(res: Any, findings: list[Finding], target: str, slot: int = 0,
                    replay: Any = None, any_text: bool = False,
                    deadline: float | None = None, release: str | None = None) -> str | None:
    """A counterexample on ``target``, the release a finding was found on,
    that no longer fails once that finding's fix is applied
    (``TARGET+FIX.diff``, replayed beside it) is that finding; None when no
    fix clears it, or when ``deadline`` (time.monotonic) passes first."""
    import time

    if replay is None:
        from properties.jobs import replay_beside

        def replay(trace: Any, fixed: str) -> Any:
            return replay_beside(trace, fixed, slot=slot)
    from impl.vllm import worker_started

    for f in fix_candidates(res, findings, release or target, any_text):
        # a fix's tree runs in a worker of its own, started on first use
        fixed = with_fix(target, f.fixed_by)
        need = REPLAY_S if worker_started(fixed, slot) else FIX_START_S
        if deadline is not None and time.monotonic() > deadline - need:
            return None
        rr = replay(res.trace, fixed)
        if rr.crash is None and not rr.violations:
            return f.name
    return None


def exposed(res: Any, findings: list[Finding], target: str, release: str | None,
            slot: int = 0, deadline: float | None = None) -> str | None:
    """The known finding of ``release`` a counterexample found on ``target``
    alone is, seen through the change (a changed eviction order reaching a
    failed load's cached block by another trace): its property and text are
    the finding's, and it holds once that finding's fix is applied to the
    target itself (``vllm@PATH+FIX.diff``). None when no such fix applies to
    the target or clears it (then the change brought it)."""
    if not release or res.trace is None:
        return None
    try:
        return classify_by_fix(res, findings, target, slot, deadline=deadline,
                               release=f"vllm@{release}")
    except Exception:  # noqa: BLE001 - a fix that does not apply to the change's tree
        return None


def name_of(res: Any, findings: list[Finding], release: str | None, slot: int = 0,
            deadline: float | None = None, any_text: bool = True) -> tuple[str | None, str]:
    """The known finding a counterexample on ``release`` is, and how it was
    told: by its shape (``""``), else by a fix that clears it
    (``" (gone on its fix)"``; ``any_text``: a fix of any finding whose
    events it holds, so a bug seen through another property is named too)."""
    import time

    known = classify(res, findings)
    if known is not None:
        return known, ""
    if release and res.trace is not None and (deadline is None or time.monotonic() < deadline):
        known = classify_by_fix(res, findings, f"vllm@{release}", slot, any_text=any_text,
                                deadline=deadline)
        if known is not None:
            return known, " (gone on its fix)"
    return None, ""
