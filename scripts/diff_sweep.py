"""Run random traces on the reference target and a vLLM target; tally where
they first disagree. Keeps the reference faithful to vLLM.

    .venv/bin/python scripts/diff_sweep.py --version 0.33.0 --kinds sliding,full --n 40

``--compare letgo --depth 1`` measures property 6's comparison on a vLLM
target (the reference under ``settled`` as its twin): each trace either
agrees, or *parts* (the steps differ: no verdict after that), or lets go of
different blocks while the steps agree (what property 6 would report).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from confirm.differential import diff, random_config, random_trace  # noqa: E402
from impl.target import TargetCrash, Unsupported, make_target  # noqa: E402
from model.observations import FreeObs  # noqa: E402
from properties.invariants import twin_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--kinds", default="sliding,chunked_local,full,hybrid")
    ap.add_argument("--n", type=int, default=20, help="traces per kind")
    ap.add_argument("--length", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depth", type=int, default=None, help="every trace at this depth "
                    "(default: 1 or 2, drawn)")
    ap.add_argument("--prefix-caching", choices=("drawn", "on", "off"), default="drawn",
                    help="drawn: on for full attention 30%% of the time (Mamba: always on)")
    ap.add_argument("--compare", choices=("all", "letgo"), default="all",
                    help="all: the differential view; letgo: property 6's on vLLM")
    ap.add_argument("--save", default=None, help="folder for the first trace of each difference")
    a = ap.parse_args()
    if a.compare == "letgo" and a.depth != 1:
        print("--compare letgo is property 6's view: it needs --depth 1", file=sys.stderr)
        return 2
    ref, vl = make_target("reference"), make_target(f"vllm@{a.version}")
    fixed = vl.capabilities.fixed_policy or "settled"
    tally: collections.Counter = collections.Counter()
    compared: collections.Counter = collections.Counter()  # events compared, per kind
    frees: collections.Counter = collections.Counter()  # blocks let go in them, per kind
    window: collections.Counter = collections.Counter()  # of them out of the window
    first: dict = {}
    rng = random.Random(a.seed)
    for kind in a.kinds.split(","):
        for _ in range(a.n):
            over = {} if a.depth is None else {"depth": a.depth}
            if a.prefix_caching != "drawn" or kind == "mamba":
                over["prefix_caching"] = a.prefix_caching == "on" or kind == "mamba"
            cfg = random_config(kind, rng, "settled" if a.compare == "letgo" else fixed, **over)
            try:
                vl.reset(cfg)
            except Unsupported:
                tally[(kind, "config unsupported by vLLM")] += 1
                continue
            except TargetCrash as e:
                tally[(kind, "vLLM crashed at startup: " + str(e).strip().splitlines()[-1])] += 1
                continue
            if a.compare == "letgo" and twin_config(cfg, vl.capabilities.fixed_policy) is None:
                tally[(kind, "no twin (a Mamba group)")] += 1
                continue
            try:
                trace = random_trace(cfg, rng, a.length, [make_target("reference"), vl])
            except Unsupported as e:
                tally[(kind, f"reference refuses: {e}")] += 1
                continue
            diffs, n = diff(trace, ref, vl, view=a.compare)
            what = diffs[0].what if diffs else "agree"
            key = (kind, what)
            tally[key] += 1
            upto = diffs[0].index if diffs else len(trace.events)
            compared[kind] += upto
            if a.compare == "letgo":  # the blocks vLLM let go in the events compared
                vl.reset(cfg)
                for ev in trace.events[:upto]:
                    for it in vl.apply(ev).items:
                        if type(it) is FreeObs:
                            frees[kind] += 1
                            window[kind] += it.reason == "window"
            if diffs and key not in first:
                first[key] = (diffs[0], trace)
    for (kind, what), n in sorted(tally.items()):
        print(f"{kind:14} {n:4}  {what}")
    print("events compared: " + ", ".join(f"{k} {v}" for k, v in compared.items()))
    if a.compare == "letgo":
        print("blocks let go in them (vLLM; out of window): "
              + ", ".join(f"{k} {v} ({window[k]})" for k, v in frees.items()))
    for (kind, what), (d, trace) in first.items():
        print(f"\n== {kind}: {what}\n{trace.config.label()}\n{d}")
        if a.save:
            path = trace.save(Path(a.save) / f"diff-{kind}.json")
            print(f"trace: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
