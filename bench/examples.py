"""Examples per CPU second of one fuzz job beside its target, and where it goes.

``python -m bench.examples --target vllm@0.33.0 --seed 0 --examples 300``
runs :func:`properties.jobs.fuzz_job` in a worker beside the target (the
worker started, and vLLM imported, before anything is timed) and prints the
examples, the events, the worker's CPU and wall seconds, examples per CPU
second, and a digest of every example's config and events: two trees given
the same seed run the same examples when their digests agree. ``--profile``
runs the job under cProfile and prints the share of CPU by layer (vLLM's
reset and stepping, the driver, the checker, the state machine, Hypothesis)
and the top functions by own time. ``--timers`` prints the CPU inside vLLM's
reset and events, the checker and the collector, and how Hypothesis's test
cases ended (valid, invalid, overrun). ``--repeat N`` runs it N times.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

def _layer_of(path: str) -> str:
    p = path.replace("\\", "/")
    if "/vllm/" in p and "/impl/vllm/" not in p:
        return "vllm"
    if "/impl/vllm/" in p:
        return "driver"
    if "/properties/invariants" in p:
        return "checker"
    if "/properties/" in p:
        return "state machine"
    if "/hypothesis/" in p:
        return "hypothesis"
    if "/model/" in p:
        return "model"
    if "/impl/" in p:
        return "target glue"
    if "/torch/" in p:
        return "torch"
    return "other"


def _profile_summary(pr: cProfile.Profile, top: int) -> dict[str, Any]:
    st = pstats.Stats(pr)
    own: dict[str, float] = {}
    total = 0.0
    for (path, _line, _fn), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore
        own[_layer_of(path)] = own.get(_layer_of(path), 0.0) + tt
        total += tt
    # inclusive time of the calls that reset vLLM and that collect garbage
    incl = {}
    for (path, _line, fn), (_cc, _nc, _tt, ct, _callers) in st.stats.items():  # type: ignore
        name = f"{Path(path).stem}.{fn}"
        if name in ("driver.reset", "driver.apply", "invariants.feed", "gc.collect",
                    "machine._apply", "machine.setup", "machine.teardown") or fn in (
                "run_state_machine",):
            incl[name] = incl.get(name, 0.0) + ct
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return {"total": total, "own": own, "inclusive": incl, "top": buf.getvalue()}


def _timers() -> tuple[dict[str, float], Any]:
    """CPU seconds inside vLLM's reset, the driver's events, the checker and
    the garbage collector (wrappers and ``gc.callbacks``; a few % overhead):
    a share not inflated by a profiler; and how many of Hypothesis's test
    cases ended valid, invalid or overrun. Returns the totals and an undo."""
    import gc

    from properties.invariants import Checker

    tot: dict[str, float] = {"reset": 0.0, "apply": 0.0, "checker": 0.0, "gc": 0.0}
    undo = []

    def wrap(cls: Any, name: str, key: str) -> None:
        orig = getattr(cls, name)

        def w(*a: Any, **k: Any) -> Any:
            c0 = time.process_time()
            try:
                return orig(*a, **k)
            finally:
                tot[key] += time.process_time() - c0
        setattr(cls, name, w)
        undo.append(lambda: setattr(cls, name, orig))

    try:
        from impl.vllm.driver import Driver
        wrap(Driver, "reset", "reset")
        wrap(Driver, "apply", "apply")
    except ImportError:  # the reference target: no vLLM here
        pass
    wrap(Checker, "feed", "checker")
    t0 = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            t0[0] = time.process_time()
        else:
            tot["gc"] += time.process_time() - t0[0]
    gc.callbacks.append(on_gc)
    undo.append(lambda: gc.callbacks.remove(on_gc))
    # how each of Hypothesis's test cases ended: VALID (completed), INVALID
    # (stopped at a draw, e.g. rule selection with every rule whose
    # precondition holds switched off by its feature flags), OVERRUN (a
    # replayed or mutated choice sequence ran out); every one ran setup
    from hypothesis.internal.conjecture.engine import ConjectureRunner

    test_function = ConjectureRunner.test_function

    def counted(runner: Any, data: Any) -> Any:
        try:
            return test_function(runner, data)
        finally:
            key = f"cases {data.status.name.lower()}"
            tot[key] = tot.get(key, 0) + 1
    ConjectureRunner.test_function = counted  # type: ignore[method-assign]
    undo.append(lambda: setattr(ConjectureRunner, "test_function", test_function))
    return tot, lambda: [u() for u in undo]


def timed_job(spec: Any, examples: int, seed: int, profile: bool = False,
              top: int = 25, dump: str | None = None, timers: bool = False,
              gc_threshold: tuple[int, ...] | None = None) -> dict[str, Any]:
    """In the worker: :func:`properties.jobs.fuzz_job` timed in this
    process's CPU, with a digest of every example it ran (``gc_threshold``:
    the collector's thresholds for this run, then the worker's again)."""
    import gc

    import properties.machine as m
    from properties.jobs import fuzz_job

    h = hashlib.sha256()
    orig = m.fuzz

    def fuzz(*a: Any, on_example: Any = None, **k: Any) -> Any:
        def hook(phase: str, machine: Any) -> None:
            if phase != "setup":
                h.update(repr((machine.cfg, machine.events)).encode())
            if on_example is not None:
                on_example(phase, machine)
        return orig(*a, on_example=hook, **k)

    m.fuzz = fuzz
    pr = cProfile.Profile() if profile else None
    tot, undo = _timers() if timers else (None, None)
    before = gc.get_threshold()
    if gc_threshold:
        gc.set_threshold(*gc_threshold)
    try:
        c0, w0 = time.process_time(), time.perf_counter()
        if pr is not None:
            pr.enable()
        res = fuzz_job(spec, examples, seed)
        if pr is not None:
            pr.disable()
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    finally:
        m.fuzz = orig
        gc.set_threshold(*before)
        if undo is not None:
            undo()
    out = {"examples": res.stats.examples, "events": sum(res.stats.events.values()),
           "cpu_s": cpu, "wall_s": wall, "verdict": res.verdict, "digest": h.hexdigest()[:16]}
    if tot is not None:
        out["timers"] = tot
    if pr is not None:
        out["profile"] = _profile_summary(pr, top)
        if dump:
            pr.dump_stats(dump)
    return out


def main(argv: list[str] | None = None) -> int:
    from properties.jobs import _call
    from properties.machine import FuzzSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="vllm@0.33.0")
    ap.add_argument("--kind", default="full")
    ap.add_argument("--hazard", default="ordered")
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timers", action="store_true",
                    help="CPU inside vLLM's reset and events, the checker and the collector, "
                         "and how Hypothesis's test cases ended")
    ap.add_argument("--gc", default=None,
                    help="the collector's thresholds for the run, e.g. 20000,20,20")
    ap.add_argument("--dump", default=None, help="with --profile: write the pstats here")
    a = ap.parse_args(argv)
    spec = FuzzSpec(target=a.target, kind=a.kind, hazard=a.hazard, depth=a.depth,
                    external=False)
    from impl.target import worker_for

    worker_for(a.target, 0)  # started (vLLM imported) before anything is timed
    for _ in range(a.repeat):
        r = _call(a.target, 0, "bench.examples:timed_job",
                  (spec, a.examples, a.seed, a.profile, a.top,
                   a.dump and str(Path(a.dump).resolve()), a.timers,
                   tuple(int(x) for x in a.gc.split(",")) if a.gc else None))
        print(f"{a.target} kind={a.kind} hazard={a.hazard} depth={a.depth} seed={a.seed}: "
              f"{r['examples']} examples, {r['events']} events, {r['cpu_s']:.2f} s CPU, "
              f"{r['wall_s']:.2f} s wall, {r['examples'] / r['cpu_s']:.1f} examples per CPU "
              f"second, verdict {r['verdict']}, digest {r['digest']}", flush=True)
        t = r.get("timers")
        if t:
            print("  CPU in: " + ", ".join(f"{k} {v:.2f} s ({100 * v / r['cpu_s']:.0f}%)"
                                           for k, v in t.items() if not k.startswith("cases")))
            print("  Hypothesis's test cases: " + ", ".join(
                f"{k.split()[1]} {v}" for k, v in sorted(t.items()) if k.startswith("cases")))
        p = r.get("profile")
        if p:
            tot = p["total"] or 1.0
            print("  own time by layer: " + ", ".join(
                f"{k} {100 * v / tot:.0f}%" for k, v in sorted(p["own"].items(),
                                                               key=lambda kv: -kv[1])))
            print("  inclusive: " + ", ".join(
                f"{k} {100 * v / tot:.0f}%" for k, v in sorted(p["inclusive"].items(),
                                                               key=lambda kv: -kv[1])))
            print(p["top"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
