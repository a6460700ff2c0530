#!/usr/bin/env python3
"""Write impl/vllm/families/block_sizes.json: the block sizes vLLM's own
``Platform._align_hybrid_block_size`` gives the model families of
impl/vllm/layouts.py, measured on a vLLM release.

    .venv/bin/python scripts/engine_layouts.py [--release 0.33.0] [--check]

``--check`` compares instead of writing (exit 1 where they differ).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measured(release: str) -> dict:
    """impl.vllm.layouts.measure() run in a process with the release on its path."""
    from impl.vllm import resolve, worker_env

    inst = resolve(release)
    env = {**os.environ, **worker_env(inst),
           "PYTHONPATH": os.pathsep.join([*map(str, inst.path), str(ROOT)])}
    code = "import json; from impl.vllm.layouts import measure; print(json.dumps(measure()))"
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True)
    if p.returncode:
        raise SystemExit(f"engine_layouts: vLLM {release} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--release", default="0.33.0")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from impl.vllm.layouts import TABLE

    got = measured(a.release)
    if a.check:
        kept = json.loads(TABLE.read_text())
        print(json.dumps(got, indent=1))
        return 0 if kept == got else 1
    TABLE.write_text(json.dumps(got, indent=1) + "\n")
    print(f"{TABLE.relative_to(ROOT)}: {got['families']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
