"""Long traces for the cost-in-trace-length checks (README, "Input limits").

Two shapes, written as trace JSON that ``./kvcheck replay`` takes:

``requests``  a stream of ``N`` requests, ``concurrency`` of them in the
              system at a time (a finished one is replaced by the next),
              Schedule / Process as the engine steps (``depth`` in flight):
              requests that finish must leave the targets' and the checker's
              state, or each event costs more than the last;
``pairs``     one request of one long decode, ``N`` Schedule / Process pairs;
``burst``     ``N`` AddRequests before anything is scheduled, then the engine
              loop until every request has finished, the pool holding only
              ``concurrency`` of them at a time: every event sees thousands of
              requests live (waiting), so its cost must follow what it
              touches, not what is live.

The first two are generated without running a target (the scheduler of both
targets makes the same choices on these shapes: the budget covers every
prompt, so each live request is scheduled at every step); ``burst`` runs the
reference target (no checker) as the engine would, Schedule while the batch
queue has room and the last one scheduled something, else Process::

    .venv/bin/python scripts/long_traces.py requests 20000 /tmp/r20k.json
    .venv/bin/python scripts/long_traces.py pairs 100000 /tmp/p100k.json
    .venv/bin/python scripts/long_traces.py burst 20000 /tmp/b20k.json
    /usr/bin/time -v ./kvcheck replay /tmp/r20k.json

``cost SHAPE N...`` replays each shape of each size beside ``--target``
(in its worker, as ``./kvcheck replay`` does, without the report) and prints
the worker's CPU µs per event: flat rows mean an event costs what it
touches, not what is live or what came before::

    .venv/bin/python scripts/long_traces.py cost burst 500 2000 11000 --target vllm@0.33.0
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from model.events import (  # noqa: E402
    AddRequest,
    Config,
    Event,
    Process,
    Schedule,
    Trace,
    config_for,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def request_stream(n: int, *, concurrency: int = 8, prompt_len: int = 40, max_new: int = 6,
                   depth: int = 2, kind: str = "sliding", prefix_caching: bool = False,
                   ) -> Trace:
    """``n`` requests through the engine, ``concurrency`` at a time, each of
    ``prompt_len`` prompt and ``max_new`` new tokens, ``depth`` steps in flight.

    The token budget covers every live request's prompt, so every live request
    runs in every step: admitted in the step after it arrives, one prefill
    step, then one token per step. With ``depth`` steps in flight the output of
    step ``s`` is processed before step ``s + depth`` is scheduled; a request
    finishes when the output of the step that computes its last token is
    processed, and the next request arrives right after."""
    B = 16
    cfg = _config(kind, concurrency, prompt_len, max_new, depth, prefix_caching, B)
    events: list[Event] = []
    # Simulate the schedule exactly as both targets make it on this shape:
    # per live request, how many tokens are still to be computed / sampled.
    live: dict[str, list[int]] = {}  # rid -> [computed, generated]
    in_flight: list[list[tuple[str, int]]] = []  # per unprocessed step: (rid, end)
    added = 0

    def top_up() -> None:
        nonlocal added
        while len(live) < concurrency and added < n:
            rid = f"r{added}"
            added += 1
            events.append(AddRequest(rid, prompt_len, max_new, 0))
            live[rid] = [0, 0]

    top_up()
    while live or in_flight:
        if len(in_flight) < depth and live:
            row = []
            for rid, st in live.items():
                c, gen = st
                known = prompt_len + gen
                placeholders = sum(1 for s in in_flight for r, e in s if r == rid
                                   and e >= prompt_len)
                if placeholders and c + 2 - placeholders >= prompt_len + max_new:
                    continue
                k = known + placeholders - c
                if k <= 0:
                    continue
                st[0] = c + k
                row.append((rid, c + k))
            if row:
                events.append(Schedule())
                in_flight.append(row)
                continue
        row = in_flight.pop(0)
        events.append(Process({}))
        for rid, end in row:
            if rid in live and end >= prompt_len:
                st = live[rid]
                st[1] = max(st[1], min(max_new, end + 1 - prompt_len))
                if st[1] >= max_new:
                    del live[rid]
        top_up()
    return Trace(cfg, events, {"generator": f"scripts/long_traces.py requests {n}"})


def pair_stream(n: int, *, kind: str = "sliding", depth: int = 1) -> Trace:
    """One request decoding through ``n`` Schedule / Process pairs (its
    prompt is one block; ``max_new_tokens`` covers every pair)."""
    B = 16
    prompt_len = B
    max_new = n + 1
    cfg = _config(kind, 1, prompt_len, max_new, depth, False, B)
    events: list[Event] = [AddRequest("r0", prompt_len, max_new, 0)]
    for _ in range(n):
        events += [Schedule(), Process({})]
    return Trace(cfg, events, {"generator": f"scripts/long_traces.py pairs {n}"})


def burst(n: int, *, concurrency: int = 8, prompt_len: int = 40, max_new: int = 6,
          depth: int = 2, kind: str = "sliding", prefix_caching: bool = False) -> Trace:
    """``n`` AddRequests in a row, then the engine loop until all have finished.
    The pool holds about ``concurrency`` requests (``max_num_seqs`` allows
    more), so the rest wait: admission stops at the first that does not fit."""
    from impl.reference.target import ReferenceTarget

    B = 16
    cfg = _config(kind, concurrency, prompt_len, max_new, depth, prefix_caching, B,
                  max_num_seqs=4 * concurrency)
    cfg = replace(cfg, num_blocks=concurrency * (_cdiv(prompt_len + max_new, B) + 2) + 1)
    events: list[Event] = [AddRequest(f"r{i}", prompt_len, max_new, 0) for i in range(n)]
    t = ReferenceTarget()
    t.reset(cfg)
    for ev in events:
        t.apply(ev)
    s = t._s
    assert s is not None
    idle = 0  # empty steps in a row with nothing else in flight
    while s.requests or s.steps:
        if len(s.steps) < depth and s.has_requests():
            busy = any(st.entries for st in s.steps)
            t.apply(Schedule())
            events.append(Schedule())
            idle = 0 if busy or s.steps[-1].entries else idle + 1
            if idle > depth:
                raise RuntimeError("the pool admits nothing: nothing in flight, nothing scheduled")
            continue
        if not s.steps:
            break
        t.apply(Process({}))
        events.append(Process({}))
    return Trace(cfg, events, {"generator": f"scripts/long_traces.py burst {n}"})


def _config(kind: str, concurrency: int, prompt_len: int, max_new: int, depth: int,
            prefix_caching: bool, B: int, max_num_seqs: int | None = None) -> Config:
    per_req = _cdiv(prompt_len + max_new, B) + 2
    budget = max(concurrency * prompt_len, 64)
    kw = {"window": 16} if kind == "sliding" else {}
    return config_for(
        kind, block_size=B, num_blocks=concurrency * per_req + 2 * _cdiv(budget, B) + 16,
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs or concurrency,
        max_model_len=prompt_len + max_new + B, depth=depth, prefix_caching=prefix_caching,
        **kw,
    )


def timed_replay(trace: Trace, target: str) -> dict:
    """In a worker: :func:`properties.replay.replay`, its CPU seconds, the
    events it replayed and its verdict."""
    import time

    from properties.replay import replay

    c0 = time.process_time()
    res = replay(trace, target)
    cpu = time.process_time() - c0
    first = res.violations[0] if res.violations else None
    return {"cpu_s": cpu, "rows": len(res.rows), "crash": res.crash,
            "violations": len(res.violations), "first": str(first) if first else None}


def cost(shape: str, sizes: list[int], target: str, kind: str, depth: int | None) -> int:
    from impl.target import worker_for
    from properties.jobs import _call

    worker_for(target, 0)  # started before anything is timed
    for n in sizes:
        if shape == "requests":
            t = request_stream(n, kind=kind, depth=depth or 2)
        elif shape == "burst":
            t = burst(n, kind=kind, depth=depth or 2)
        else:
            t = pair_stream(n, kind=kind, depth=depth or 1)
        r = _call(target, 0, "scripts.long_traces:timed_replay", (t, target))
        verdict = ("crash: " + r["crash"].splitlines()[0][:80] if r["crash"] else
                   f"{r['violations']} violation(s)")
        print(f"{shape} {n}: {len(t.events)} events, {r['rows']} replayed, {r['cpu_s']:.2f} s "
              f"CPU, {1e6 * r['cpu_s'] / max(1, r['rows']):.0f} µs per event ({verdict})",
              flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["cost"]:
        cp = argparse.ArgumentParser(prog="long_traces.py cost")
        cp.add_argument("shape", choices=("requests", "pairs", "burst"))
        cp.add_argument("n", type=int, nargs="+")
        cp.add_argument("--target", default="vllm@0.33.0")
        cp.add_argument("--kind", default="sliding")
        cp.add_argument("--depth", type=int, default=None)
        c = cp.parse_args(argv[1:])
        return cost(c.shape, c.n, c.target, c.kind, c.depth)
    ap.add_argument("shape", choices=("requests", "pairs", "burst"))
    ap.add_argument("n", type=int)
    ap.add_argument("out", type=Path)
    ap.add_argument("--kind", default="sliding")
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--prefix-caching", action="store_true")
    a = ap.parse_args(argv)
    if a.shape == "requests":
        t = request_stream(a.n, kind=a.kind, depth=a.depth or 2,
                           prefix_caching=a.prefix_caching)
    elif a.shape == "burst":
        t = burst(a.n, kind=a.kind, depth=a.depth or 2, prefix_caching=a.prefix_caching)
    else:
        t = pair_stream(a.n, kind=a.kind, depth=a.depth or 1)
    t.save(a.out)
    print(f"{a.out}: {len(t.events)} events, "
          f"{sum(isinstance(e, AddRequest) for e in t.events)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
