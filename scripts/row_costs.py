#!/usr/bin/env python3
"""gate/row_costs.json, the seconds each gate row took (``engine:row id``),
from gate runs' ``gate.json`` (the shard split's weights, gate/shards.py).

    .venv/bin/python scripts/row_costs.py REPORT_DIR [REPORT_DIR ...]

A row in several runs gets its mean; rows of the file no run names are kept.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gate.shards import COSTS, ShardError, _load, engine, load_costs  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    seen: dict[str, list[float]] = {}
    runs = []
    try:
        for folder in argv:
            d = _load(folder)
            commit = str((d.get("provenance") or {}).get("kvcheck") or "?")[:7]
            runs.append(f"{d['target']}: {len(d['rows'])} rows, kvcheck {commit}")
            for r in d["rows"]:
                if r.get("seconds"):
                    key = f"{engine(r.get('target') or d['target'])}:{r['id']}"
                    seen.setdefault(key, []).append(float(r["seconds"]))
    except ShardError as e:
        print(f"row_costs: {e}", file=sys.stderr)
        return 2
    costs = load_costs()
    costs.update({k: round(sum(v) / len(v), 2) for k, v in seen.items()})
    COSTS.write_text(json.dumps({"from": runs, "rows": dict(sorted(costs.items()))},
                                indent=1) + "\n")
    print(f"{COSTS}: {len(costs)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
