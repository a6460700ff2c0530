"""Run random traces on the reference target and a vLLM target; tally where
they first disagree. Keeps the reference faithful to vLLM.

    .venv/bin/python scripts/diff_sweep.py --version 0.33.0 --kinds sliding,full --n 40
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
from impl.target import Unsupported, make_target  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--kinds", default="sliding,chunked_local,full,hybrid")
    ap.add_argument("--n", type=int, default=20, help="traces per kind")
    ap.add_argument("--length", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="folder for the first trace of each difference")
    a = ap.parse_args()
    ref, vl = make_target("reference"), make_target(f"vllm@{a.version}")
    fixed = vl.capabilities.fixed_policy or "settled"
    tally: collections.Counter = collections.Counter()
    first: dict = {}
    rng = random.Random(a.seed)
    for kind in a.kinds.split(","):
        for _ in range(a.n):
            cfg = random_config(kind, rng, fixed)
            try:
                vl.reset(cfg)
            except Unsupported:
                tally[(kind, "config unsupported by vLLM")] += 1
                continue
            trace = random_trace(cfg, rng, a.length, [make_target("reference"), vl])
            diffs, _ = diff(trace, ref, vl)
            key = (kind, diffs[0].what if diffs else "agree")
            tally[key] += 1
            if diffs and key not in first:
                first[key] = (diffs[0], trace)
    for (kind, what), n in sorted(tally.items()):
        print(f"{kind:14} {n:4}  {what}")
    for (kind, what), (d, trace) in first.items():
        print(f"\n== {kind}: {what}\n{trace.config.label()}\n{d}")
        if a.save:
            path = trace.save(Path(a.save) / f"diff-{kind}.json")
            print(f"trace: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
