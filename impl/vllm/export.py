"""A trace as a standalone test in vLLM's own style (``./kvcheck export TRACE
--vllm-test OUT.py``).

The module written is the trace's config and events as data, followed by
:mod:`impl.vllm.vllm_test_harness` (which builds the scheduler as vLLM's
``tests/v1/core`` and ``tests/v1/kv_connector/unit`` tests do, replays the
events through ``schedule()`` / ``update_from_output()`` and asserts property
2 on vLLM's objects, and property 7 in a trace's closing Drain) and one test
function. It needs vLLM (0.33 line) and pytest only. Nothing here imports
vLLM.

What it cannot state is refused with one line (:class:`ExportError`): a
violation of another property than 2 or 7 (the exported test asserts reads and
progress, and fails on crashes), a Drain but as the closing event of a trace
that shows property 7, a drafter other than n-gram, EAGLE and MTP, a failed
load beside Mamba drafts, a kind it does not model.
"""

from __future__ import annotations

import pprint
import re
import textwrap
from pathlib import Path

from model.events import (
    NO_PREEMPT_CALL,
    Abort,
    AddRequest,
    Drain,
    FailLoad,
    Finish,
    Preempt,
    Process,
    ResetPrefixCache,
    Schedule,
    Trace,
)
from model.tokens import prompt_token

HARNESS = Path(__file__).resolve().parent / "vllm_test_harness.py"
KINDS = {"full", "sliding", "chunked_local", "mamba", "rswa", "sink"}


class ExportError(Exception):
    """The trace cannot be exported (one line)."""


def _events(trace: Trace) -> list[tuple]:
    out: list[tuple] = []
    for i, ev in enumerate(trace.events):
        t = type(ev)
        if t is AddRequest:
            out.append(("add", ev.id, [prompt_token(q, ev.variant) for q in range(ev.prompt_len)],
                        ev.max_new_tokens, ev.external_tokens))
        elif t is Schedule:
            out.append(("schedule",))
        elif t is Process:
            out.append(("process", dict(ev.accepted)))
        elif t is FailLoad:
            out.append(("fail_load", ev.id, ev.first_bad_block))
        elif t is ResetPrefixCache:
            out.append(("reset",))
        elif t is Preempt:
            raise ExportError(f"event #{i} (Preempt): {NO_PREEMPT_CALL}")
        elif t is Finish:
            out.append(("finish", ev.id))
        elif t is Abort:
            out.append(("abort", ev.id))
        elif t is Drain and i == len(trace.events) - 1 and _prop(trace) == "7":
            out.append(("drain",))
        elif t is Drain:
            raise ExportError(f"event #{i} (Drain) is exported only as the closing event of a "
                              f"trace that shows property 7 (there the checker judged it)")
        else:
            raise ExportError(f"event #{i} ({t.__name__}) has no vLLM-test form "
                              f"(the exported test replays schedule/update_from_output only)")
    return out


def _prop(trace: Trace) -> str | None:
    m = re.match(r"property (\d+)", str(trace.meta.get("violation", "")))
    return m[1] if m else None


def _check(trace: Trace) -> None:
    cfg = trace.config
    if cfg.spec_tokens and cfg.drafter not in ("ngram", "eagle", "mtp"):
        raise ExportError(f"drafter {cfg.drafter} is not built by the exported test "
                          f"(ngram, eagle and mtp are)")
    if cfg.spec_tokens and any(g.kind == "mamba" for g in cfg.groups) and \
            any(type(ev) is FailLoad for ev in trace.events):
        raise ExportError("a failed load beside Mamba drafts has no vLLM-test form (the "
                          "exported test keeps drafted Mamba states in the worker's slots, "
                          "which no failed load spoils)")
    bad = sorted({g.kind for g in cfg.groups} - KINDS)
    if bad:
        raise ExportError(f"kind {bad[0]} is not modeled by the exported test")
    target = str(trace.meta.get("target", "vllm@0.33.0"))
    m = re.match(r"vllm@(\d+\.\d+)\.", target)
    if m and m[1] != "0.33":
        raise ExportError(f"the trace shows on {target}; the exported test speaks vLLM 0.33's "
                          f"API (schedule(), the planner, KVConnectorOutput) and runs on that line")
    prop = _prop(trace)
    if prop not in (None, "2", "7"):
        raise ExportError(f"the trace shows property {prop}; the exported test asserts property "
                          f"2 (reads) and 7 (progress, in a closing Drain) and fails on a crash")
    if prop == "7" and not (trace.events and type(trace.events[-1]) is Drain):
        raise ExportError("the trace shows property 7 without a closing Drain; the exported "
                          "test judges progress only in one")


def _identifier(name: str) -> str:
    s = re.sub(r"\W+", "_", name).strip("_").lower()
    return s if s and not s[0].isdigit() else f"t_{s}"


HELPER = "kvcheck_replay.py"  # the replaying form's helpers, beside each test
SPDX = ("# SPDX-License-Identifier: Apache-2.0\n"
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n")


def _docstring(trace: Trace, name: str) -> str:
    meta = trace.meta
    lines = [*textwrap.wrap(f"{name}: a kvcheck trace replayed on vLLM's scheduler.", 76), ""]
    if "violation" in meta:
        from .export_steps import _where

        target = str(meta.get("target") or "vllm@0.33.0")
        where, on = _where(target, target.partition("@")[2].partition("+")[0] or "0.33.0")
        lines += textwrap.wrap(f"Found by kvcheck on {where}; replayed on {on}: "
                               f"{meta['violation']}", 76, break_on_hyphens=False)
    if "fixed_by" in meta:
        from .export_steps import passes_with

        lines += passes_with(meta["fixed_by"], 76)
    lines += ["", *textwrap.wrap(f"Config: {trace.config.label()}", 76),
              *textwrap.wrap("Written by `./kvcheck export TRACE --vllm-test OUT.py` from "
                             "the trace; kvcheck_replay.Replay (beside it) replays the "
                             "calls and asserts on vLLM's objects at every step (its "
                             "docstring says what). Needs vLLM (0.33 line) and pytest "
                             "only.", 76)]
    text = "\n".join(lines)
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def replay_helper_source() -> str:
    """``kvcheck_replay.py``: the harness, the same beside every test."""
    return SPDX + HARNESS.read_text()


def vllm_test_source(trace: Trace, name: str) -> str:
    """The module text of ``trace`` as a vLLM-style test named ``name``,
    replayed through :data:`HELPER`."""
    _check(trace)
    events = _events(trace)
    cfg = trace.config.to_json()
    return (
        f'{SPDX}"""{_docstring(trace, name)}\n"""\n\n'
        "import pytest\n\nfrom kvcheck_replay import Replay, make_scheduler\n\n"
        "pytestmark = pytest.mark.cpu_test\n\n"
        f"CONFIG = {pprint.pformat(cfg, width=84, sort_dicts=False)}\n"
        f"EVENTS = {pprint.pformat(events, width=84, compact=True)}\n\n\n"
        f"def test_{_identifier(name)}(tmp_path):\n"
        f"    sched, hasher = make_scheduler(CONFIG, tmp_path)\n"
        f"    failure = Replay(CONFIG, sched, hasher).run(EVENTS)\n"
        f"    assert failure is None, failure\n"
    )
