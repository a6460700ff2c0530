"""A last shrinking pass over a counterexample, on the trace itself.

Hypothesis shrinks the choices behind a run; a choice that names a request by
its position in a list can keep it from deleting an early, irrelevant request.
This pass works on events instead: it drops whole requests (with every event
that names them), then single events, then lowers prompt lengths, keeping a
change (also a pair of neighbours, such as a step and its output) only when
the replayed trace is still valid for the target and still
violates the same property. Finally requests are renamed ``r0, r1, ...`` in
order of arrival. Deterministic, and as cheap as a few dozen replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from impl.target import Target, TargetCrash
from model.events import AddRequest, Event, Process, Trace, TraceError, check_consistent
from properties.replay import InvalidEvent, replay


def _names(ev: Event) -> set[str]:
    if isinstance(ev, Process):
        return set(ev.accepted)
    rid = getattr(ev, "id", None)
    return {rid} if rid else set()


def _drop_request(events: list[Event], rid: str) -> list[Event]:
    out = []
    for ev in events:
        if isinstance(ev, Process) and rid in ev.accepted:
            ev = Process({k: v for k, v in ev.accepted.items() if k != rid})
        elif rid in _names(ev):
            continue
        out.append(ev)
    return out


def _rename(events: list[Event]) -> list[Event]:
    order = [ev.id for ev in events if isinstance(ev, AddRequest)]
    new = {old: f"r{i}" for i, old in enumerate(order)}
    out = []
    for ev in events:
        if isinstance(ev, Process):
            out.append(Process({new.get(k, k): v for k, v in ev.accepted.items()}))
        elif hasattr(ev, "id"):
            out.append(replace(ev, id=new.get(ev.id, ev.id)))
        else:
            out.append(ev)
    return out


def _lower_one(events, violating_prefix, block_size: int):
    """``events`` with one number of one AddRequest lowered, if the violation
    survives it; else None. Block-aligned external token counts (what
    block-granular connectors offer) stay aligned."""
    for i, ev in enumerate(events):
        if not isinstance(ev, AddRequest):
            continue
        for field in ("variant", "external_tokens", "max_new_tokens", "prompt_len"):
            lo = 0 if field in ("variant", "external_tokens") else 1
            val = getattr(ev, field)
            for smaller in sorted({lo, val // 2, val - 1}):
                if field == "external_tokens" and val % block_size == 0:
                    smaller -= smaller % block_size
                if not lo <= smaller < val:
                    continue
                cand = replace(ev, **{field: smaller})
                if cand.external_tokens >= cand.prompt_len:
                    continue
                got = violating_prefix(events[:i] + [cand] + events[i + 1:])
                if got is not None:
                    return got
    return None


def minimize(trace: Trace, target: Target, prop: int, budget: int = 400,
             keep: Callable[[Trace], bool] | None = None,
             seconds: float | None = None) -> Trace:
    """The shortest variant of ``trace`` found that still violates ``prop``
    (and that ``keep`` accepts: the gate keeps only what its base does not
    fail alike), in at most ``budget`` replays and about ``seconds``."""
    import time

    cfg, meta = trace.config, trace.meta
    tries = 0
    end = None if seconds is None else time.monotonic() + seconds

    def more() -> bool:
        return tries < budget and (end is None or time.monotonic() < end)

    def violating_prefix(events: list[Event]) -> list[Event] | None:
        nonlocal tries
        tries += 1
        cand = Trace(cfg, events, meta)
        try:
            check_consistent(cand)
            rr = replay(cand, target, props=frozenset({prop}))
        except (InvalidEvent, TraceError, TargetCrash):
            return None
        if rr.crash or rr.first is None or rr.first.prop != prop:
            return None
        out = events[: rr.rows[-1].index + 1]
        if keep is not None and not keep(Trace(cfg, out, meta)):
            return None
        return out

    events = violating_prefix(list(trace.events))
    if events is None:  # not reproducible as a trace: leave it as it is
        return trace
    changed = True
    while changed and more():
        changed = False
        for rid in [ev.id for ev in events if isinstance(ev, AddRequest)]:
            got = violating_prefix(_drop_request(events, rid))
            if got is not None:
                events, changed = got, True
        i = len(events) - 1
        while i >= 0 and more():
            if not isinstance(events[i], AddRequest):
                got = violating_prefix(events[:i] + events[i + 1:])
                if got is not None:
                    events, changed = got, True
            i = min(i, len(events)) - 1
        i = len(events) - 2
        while not changed and i >= 0 and more():  # a step with its output
            if not any(isinstance(e, AddRequest) for e in events[i:i + 2]):
                got = violating_prefix(events[:i] + events[i + 2:])
                if got is not None:
                    events, changed = got, True
            i -= 1
        if not changed:
            got = _lower_one(events, violating_prefix, cfg.block_size)
            if got is not None:
                events, changed = got, True
    final = _rename(events)
    if violating_prefix(final) is None:
        final = events
    return Trace(cfg, final, meta)
