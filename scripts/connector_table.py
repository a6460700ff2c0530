#!/usr/bin/env python3
"""docs/TARGETS.md's table of vLLM's shipped KV connectors, from what
building each one's scheduler half on this machine does
(``impl.vllm.connectors.probe_job``, in a worker of vLLM 0.33.0).

    .venv/bin/python scripts/connector_table.py [--check]

Writes the table between its markers; ``--check`` writes nothing and exits 1
when the committed table is not what the probe says. Exit 2: no such markers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from impl.vllm.connectors import BEGIN, END, render  # noqa: E402
from properties.jobs import _call  # noqa: E402

DOC = ROOT / "docs" / "TARGETS.md"
TARGET = "vllm@0.33.0"


def table() -> str:
    return render(_call(TARGET, 0, "impl.vllm.connectors:probe_job", ()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if a.check:
        if new != text:
            print(f"{DOC}: the connector table is not what the probe says; "
                  f"run scripts/connector_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
