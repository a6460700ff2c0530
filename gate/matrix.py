"""The matrix a reviewer needs for one vLLM: its rows, their ids, their specs.

Every kind the target supports x hazard ordered / unordered x depth 1 / 2 / 3
(pipeline parallel) x drafts off / on (2 draft tokens) x prefix caching off /
on x connector loads that never fail / may fail (unordered only: loads need a
KV-consumer connector). Rows the target cannot run are left out with the
reason (Mamba's align mode: prefix caching on; no prefix-caching rows for a
kind that takes no prefix hits, a ring or cross attention; no connector rows
and no pipeline-parallel rows for cross attention, which vLLM runs without
either; failed loads on several KV-cache groups, a hybrid or a ring beside
full attention, only where the tree survives them).

A row id is short and the same on every machine: the kind, then the knobs
(``sliding-unordered-d2-k2-pc-fl``: unordered hazard, depth 2, two draft
tokens, prefix caching on, failed loads on; ``full-ordered-d1-k2-pc-eagle``:
an EAGLE drafter, no connector, so no loads); no path, and no policy on a
target that implements its own. The nightly puts the target in front.
"""

from __future__ import annotations

import fnmatch
from typing import Any

DEPTHS = (1, 2, 3)
DRAFTS = 2  # draft tokens of a "drafts on" row
KINDS = ("full", "sliding", "chunked_local", "rswa", "mamba", "sink", "ring", "cross", "hybrid")
KNOBS = {"depth": int, "spec_tokens": int, "hazard": str, "prefix_caching": bool,
         "block_size": int, "external": bool, "aligned_loads": bool, "failed_loads": bool,
         "steps": int, "drafter": str, "block_sizes": str, "match_unit": str}
# how each knob is written in a row id: (prefix or the on / off words)
_ID = {"depth": "d", "spec_tokens": "k", "block_size": "b", "steps": "s", "match_unit": "unit-",
       "prefix_caching": ("pc", "nopc"), "failed_loads": ("fl", "nofl"),
       "external": ("ext", "noext"), "aligned_loads": ("aligned", "unaligned")}
_ORDER = ("hazard", "depth", "spec_tokens", "prefix_caching", "failed_loads", "external",
          "block_size", "aligned_loads", "steps", "drafter", "block_sizes", "match_unit")
# vLLM paths the cross product above does not take, one row per depth 1 / 2
# each (ordered hazard, no failed loads): (kind, knobs, the path)
FEATURES = (
    ("full", {"spec_tokens": DRAFTS, "prefix_caching": True, "drafter": "eagle"},
     "an EAGLE drafter: hashes and lookahead of the draft's extra token"),
    ("sliding", {"spec_tokens": DRAFTS, "prefix_caching": False, "drafter": "eagle"},
     "an EAGLE drafter's lookahead beside a window"),
    ("sliding", {"spec_tokens": DRAFTS, "prefix_caching": False, "drafter": "mtp"},
     "an MTP drafter's retained tokens beside a window"),
    ("mamba", {"spec_tokens": DRAFTS, "prefix_caching": True, "drafter": "eagle"},
     "an EAGLE drafter beside Mamba (a draft group of its own)"),
    ("hybrid", {"spec_tokens": DRAFTS, "prefix_caching": True, "drafter": "mtp"},
     "an MTP drafter on a hybrid model"),
    # blocks of 4 tokens: a group's hash-unit edges come every few tokens
    ("hybrid", {"spec_tokens": 0, "prefix_caching": True, "block_sizes": "mixed",
                "block_size": 4},
     "groups of 1, 2 or 4 times the block size (hash units finer than a block)"),
    ("hybrid", {"spec_tokens": 0, "prefix_caching": True, "match_unit": "fine"},
     "prefix hits ending inside a block (prefix_match_unit below the block size)"),
)


def target_label(target: str) -> str:
    """A target's name in a row id: a release as it is, a checkout as
    ``vllm-tree`` (never its path), a patched release with its diffs' stems."""
    from pathlib import Path

    from impl.vllm.overlay import _stem, series

    engine, _, rest = target.partition("@")
    if not rest:
        return engine
    release, _, patches = rest.partition("+")
    if "/" in release or release.startswith((".", "~")):
        release = "tree"
    return "-".join([engine, release, *(_stem(Path(d)) for d in series(patches) if patches)])


def row_id(kind: str, knobs: dict, target: str | None = None,
           policy: str | None = None) -> str:
    parts = ([target_label(target)] if target else []) + [kind] + ([policy] if policy else [])
    for k in _ORDER:
        if k not in knobs:
            continue
        v, how = knobs[k], _ID.get(k)
        if k == "external" and "hazard" in knobs and v == (knobs["hazard"] == "unordered"):
            continue  # implied by the hazard (a connector is what makes it unordered)
        if k == "failed_loads" and not v and knobs.get("hazard") == "ordered":
            continue  # implied: loads come from a connector, which an ordered row has not
        if isinstance(how, tuple):
            parts.append(how[0] if v else how[1])
        elif how:
            parts.append(f"{how}{v}")
        else:
            parts.append(str(v))
    return "-".join(parts)


def make_row(target: str, kind: str, policy: str, knobs: dict, source: str = "gate",
             unavailable: str | None = None, row_id_: str | None = None) -> dict:
    return {"id": row_id_ or row_id(kind, knobs), "target": target, "kind": kind,
            "policy": policy, "knobs": knobs, "unavailable": unavailable, "source": source}


def gate_matrix(target: str, caps: Any, kinds: tuple[str, ...] | None = None,
                hybrid_failed_loads: bool = False) -> tuple[list[dict], list[str]]:
    """The rows of the module's matrix the target can run, and notes on what
    is left out. Hybrids get failed-load rows only on a tree that survives a
    block-level load failure on several KV-cache groups
    (``VllmTarget.hybrid_failed_loads``; unmodified releases crash there,
    findings/08-failed-load-hybrid-ends-engine)."""
    from model.kinds import KINDS as KIND_CLASSES
    from model.policy import DEFAULT_POLICY

    policy = caps.fixed_policy or DEFAULT_POLICY
    kinds = tuple(k for k in (kinds or KINDS) if k in caps.kinds)
    notes = [f"{target} does not support {k}: not in the matrix"
             for k in KINDS if k not in caps.kinds]
    rows = []
    for kind in kinds:
        pinned = {name: value for name, value, _ in caps.pinned.get(kind, ())}
        cls = KIND_CLASSES.get(kind)
        if cls is not None and not cls.prefix_cacheable:
            pinned.setdefault("prefix_caching", False)
        if kind in caps.ordered_only:
            pinned.setdefault("hazard", "ordered")
        several_groups = kind == "hybrid" or (cls is not None and bool(cls.beside))
        for hazard in ("ordered", "unordered"):
            if "hazard" in pinned and pinned["hazard"] != hazard:
                continue
            for depth in DEPTHS:
                if depth > caps.kind_max_depth.get(kind, (depth, ""))[0]:
                    continue
                for drafts in (0, DRAFTS):
                    if "spec_tokens" in pinned and pinned["spec_tokens"] != drafts:
                        continue
                    for prefix in (False, True):
                        if "prefix_caching" in pinned and pinned["prefix_caching"] != prefix:
                            continue
                        loads = (False,) if hazard == "ordered" else (False, True)
                        for fail in loads:
                            if fail and several_groups and not hybrid_failed_loads:
                                continue
                            knobs = {"hazard": hazard, "depth": depth, "spec_tokens": drafts,
                                     "prefix_caching": prefix, "external": hazard == "unordered",
                                     "failed_loads": fail}
                            rows.append(make_row(target, kind, policy, knobs))
    if "mamba" in kinds:
        notes.append("mamba: prefix caching on only (vLLM's align mode here)")
    for k in ("ring", "cross"):
        if k in kinds:
            notes.append(f"{k}: no prefix-caching rows (vLLM's "
                         f"{KIND_CLASSES[k].vllm_manager} takes no prefix hits)")
    for k in caps.ordered_only:
        if k in kinds:
            notes.append(f"{k}: ordered rows only ({caps.ordered_only[k]})")
    for k, (depth, why) in caps.kind_max_depth.items():
        if k in kinds:
            notes.append(f"{k}: depth {depth} at most ({why})")
    several = [k for k in kinds if k not in caps.ordered_only and (
        k == "hybrid" or (KIND_CLASSES.get(k) is not None and KIND_CLASSES[k].beside))]
    if several and not hybrid_failed_loads:
        notes.append(f"{', '.join(several)}: no failed-load rows (this tree crashes on a "
                     "failed load over several KV-cache groups, "
                     "findings/08-failed-load-hybrid-ends-engine)")
    return rows, notes


def feature_rows(target: str, caps: Any) -> list[dict]:
    """The rows of :data:`FEATURES` whose kind the target supports, at depth 1
    and 2; each carries ``feature`` (the path it takes). Whether the target's
    version has the path is for the gate to ask (:func:`gate.run.refusal`)."""
    from model.policy import DEFAULT_POLICY

    policy = caps.fixed_policy or DEFAULT_POLICY
    rows = []
    for kind, knobs, what in FEATURES:
        if kind not in caps.kinds:
            continue
        for depth in (1, 2):
            rows.append({**make_row(target, kind, policy, {
                "hazard": "ordered", "depth": depth, **knobs, "external": False,
                "failed_loads": False}), "feature": what})
    return rows


def rare_first(rows: list[dict]) -> list[dict]:
    """The rows whose witnesses are the rarest first (stable otherwise): those
    with drafts (a rejection near a free, a Mamba checkpoint near one), the
    deeper ones first. A row extends its share until it has reached its
    witnesses, by at most what the gate has left (gate.rows); started early,
    a slow row has that time, where at the end it would have none."""
    def key(r: dict) -> tuple[int, int]:
        k = r.get("knobs") or {}
        return (0 if k.get("spec_tokens") else 1, -int(k.get("depth") or 0))

    return sorted(rows, key=key)


def narrow(rows: list[dict], patterns: list[str] | None = None,
           kinds: list[str] | None = None) -> list[dict]:
    """The rows whose id matches one of ``patterns`` (fnmatch; a pattern
    without a wildcard matches as a part of the id) and whose kind is one of
    ``kinds``."""
    out = rows
    if kinds:
        out = [r for r in out if r["kind"] in kinds]
    if patterns:
        pats = [p if any(c in p for c in "*?[") else f"*{p}*" for p in patterns]
        out = [r for r in out if any(fnmatch.fnmatchcase(r["id"], p) for p in pats)]
    return out


def spec_of(row: dict):
    from properties.machine import FuzzSpec

    k = row.get("knobs") or {}
    return FuzzSpec(target=row["target"], kind=row["kind"], policy=row["policy"],
                    depth=k.get("depth"), spec_tokens=k.get("spec_tokens"),
                    hazard=k.get("hazard"), prefix_caching=k.get("prefix_caching"),
                    block_size=k.get("block_size"), external=k.get("external", True),
                    aligned_loads=k.get("aligned_loads", True),
                    fail_loads=k.get("failed_loads", True), max_steps=k.get("steps"),
                    drafter=k.get("drafter", "ngram"),
                    block_sizes=k.get("block_sizes", "uniform"),
                    match_unit=k.get("match_unit", "block"))
