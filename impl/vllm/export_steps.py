"""A counterexample as a short, straight-line test on vLLM's own objects.

``./kvcheck export TRACE --vllm-test OUT.py`` replays the trace on vLLM
beside the checker (:func:`export_job`, in a vLLM worker) and writes the vLLM
calls the replay made, one line each: the scheduler built as the engine
builds it (``kvcheck_utils.build``, whose engine steps are
``impl/vllm/build.py``'s source), ``add_request``, ``schedule()``,
``update_from_output()`` with the model runner output each step needs, the
connector's offers and failed loads, ``finish_requests``. At the event where
the checker saw the violation it asserts what vLLM itself holds
(:attr:`properties.invariants.Violation.facts`):

* a block freed out of the window while a step in flight reads it, or while
  a rollback to the settled count would: the request's block table no longer
  holds that block at that logical index, and it is back in the pool;
* a step whose window reads a logical block the table maps to the NULL
  block (the read range computed from the request's ``num_computed_tokens``);
* a step that reads positions a failed connector load left without KV: it
  starts past them;
* a step whose output counts though it read a block whose connector load
  failed in that same output: the request took the sampled token;
* a Mamba step whose states land in one block named at two slots of the
  block table the scheduler's outputs hand the worker (``worker_block_ids``),
  or that starts from a state in a block the table names at two slots;
* a request's block table holding a block the sink's attention keeps the
  sink's KV in (physical blocks 1..S/B), written over by its step;
* a step's copy list whose copy reads a block another copy of the same
  step fills (the worker gathers every source before it scatters);
* a drain (the engine's loop) in which schedule() runs nothing while a
  request waits and nothing is in flight: the schedules that follow run
  something.

``OUT.py`` imports its helpers from ``kvcheck_utils.py``, written beside it
(the same text for every test). What this form cannot state yet raises
:class:`ExportError`, and the exporter falls back to the replaying test of
:mod:`impl.vllm.export`.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from pathlib import Path
from typing import Any

from model.events import AddRequest, Trace

UTILS = Path(__file__).resolve().parent / "kvcheck_utils.py.in"  # a template
KINDS = {"full", "sliding", "chunked_local", "mamba", "rswa", "sink"}
FACTS = {"freed_while_read", "freed_before_settled", "reads_null", "reads_failed_load",
         "output_counts_after_failed_read", "raises", "stalls", "state_clash",
         "copy_of_unfilled", "state_slot_shared", "sink_overwritten", "reads_draft_of_other"}


class ExportError(Exception):
    """This form cannot state the trace (one line)."""


class _Found(Exception):
    """A violation inside a Drain's loop: the export stops there."""

    def __init__(self, violation: Any) -> None:
        super().__init__(str(violation))
        self.violation = violation


def fed_plain(d: Any, ev: Any, live: Any, last: list) -> Any:
    """One event applied, its counters folded for a later Drain."""
    o = d.apply(ev)
    if o.counters is not None:
        last[0] = o.counters
        live.update(o.counters)
    return o


def utils_source() -> str:
    """``kvcheck_utils.py``: the helper template with the engine's steps of
    impl/vllm/build.py written in."""
    from impl.vllm import build

    body = "\n\n".join(textwrap.dedent(inspect.getsource(f))
                       for f in (build.plan_kv_cache, build.hma_as_on_cuda,
                                                   build.build_scheduler))
    text = UTILS.read_text()
    return text.replace("# <the engine's steps: impl/vllm/build.py>\n",
                        "# the engine's steps, as kvcheck's driver runs them "
                        "(impl/vllm/build.py)\n\n\n" + body + "\n")


def _check(trace: Trace) -> None:
    cfg = trace.config
    bad = sorted({g.kind for g in cfg.groups} - KINDS)
    if bad:
        raise ExportError(f"kind {bad[0]}: this form states "
                          f"{', '.join(sorted(KINDS))} layers")


def _spec_code(spec: Any) -> str:
    """The layer spec as a constructor call with the fields it needs: those
    without which it would be another spec."""
    given = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    for name in list(given):
        rest = {k: v for k, v in given.items() if k != name}
        try:
            if type(spec)(**rest) == spec:
                given = rest
        except TypeError:  # a field without a default
            continue
    common = {"num_kv_heads": 1, "head_size": 8}
    if ("block_size" in given and all(given.get(k) == v for k, v in common.items())
            and "float32" in str(given.get("dtype"))):
        # an attention layer as every one here is (kvcheck_utils.attention)
        rest = {k: v for k, v in given.items()
                if k not in ("block_size", "dtype", *common)}
        parts = [type(spec).__name__, str(given["block_size"]),
                 *(f"{k}={_value(v)}" for k, v in rest.items())]
        return f"attention({', '.join(parts)})"
    parts = [f"{k}={_value(v)}" for k, v in given.items()]
    return f"{type(spec).__name__}({', '.join(parts)})"


def _value(v: Any) -> str:
    """A spec field's value as code (torch dtypes by name, in tuples too)."""
    if isinstance(v, tuple):
        inner = ", ".join(_value(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    return "torch.float32" if "float32" in str(v) else repr(v)


def export_job(trace: Trace, name: str, found: tuple | None = None) -> tuple[str, str]:
    """In a vLLM worker: (the test's text, kvcheck_utils.py's text).
    ``found``: (property, message, facts, event index) of the violation the
    trace shows on an older release, where this vLLM holds: the test asserts
    that fact at that event (it passes here, and fails where the bug is)."""
    from impl.target import Unsupported
    from impl.vllm.driver import Driver, EventRejected, InstrumentationError
    from model.events import AddRequest, Drain, Schedule
    from model.observations import LiveCounters
    from properties.drain import drain
    from properties.invariants import Checker, Violation

    _check(trace)
    d = Driver()
    d.script = []
    checker = Checker(trace.config)
    specs = d.planned_specs(trace.config)
    try:
        checker.feed(None, d.reset(trace.config))
    except Unsupported as e:
        raise ExportError(f"vllm {d.version} refuses this config: {e}") from None
    except Exception as e:  # noqa: BLE001 - vLLM cannot build its scheduler
        line = (str(e).strip().splitlines() or [""])[0]
        v = Violation(0, f"{type(e).__name__}: {line}",
                      facts={"fact": "raises", "error": type(e).__name__, "line": line})
        body = ["assert error is None, (",
                *_message("vLLM raised {type(error).__name__}: {error}"), ")"]
        return (_module(trace, name, v, specs, body, d.version, _mode(d, trace),
                        build_raises=v.facts["error"]), utils_source())

    v, at = None, None
    reqs: dict[str, Any] = {}
    live = LiveCounters()  # as properties.replay folds them, for a Drain
    last: list[Any] = [None]

    def fed(e: Any) -> Any:
        o = fed_plain(d, e, live, last)
        found_here = checker.feed(e, o)
        if found_here:
            raise _Found(found_here[0])
        return o

    for i, ev in enumerate(trace.events):
        d.script.append(("event", i))
        if isinstance(ev, AddRequest):
            reqs[ev.id] = ev
        try:
            if isinstance(ev, Drain):  # the engine's loop, its calls recorded
                try:
                    got = drain(trace.config, checker, last[0], reqs,
                                lambda: [r for r in live.live() if r in reqs], fed, i)
                except _Found as f:
                    got = f.violation
                vs = [got] if got is not None else []
            else:
                vs = checker.feed(ev, fed_plain(d, ev, live, last))
        except (EventRejected, InstrumentationError) as e:
            raise ExportError(f"event #{i} does not replay on vllm {d.version}: {e}") from None
        except Exception as e:  # noqa: BLE001 - vLLM raised: the test asserts it does not
            if type(ev) is Schedule and d.script[-1][0] != "schedule":
                d.script.append(("schedule", "raises"))
            line = (str(e).strip().splitlines() or [""])[0]
            v = Violation(0, f"{type(e).__name__}: {line}",
                          facts={"fact": "raises", "error": type(e).__name__, "line": line})
            at = i
            break
        if vs:
            v, at = vs[0], i
            break
        if found is not None and i == found[3]:
            v, at = Violation(found[0], found[1], facts=found[2]), i
            break
    if v is None:
        raise ExportError(f"the trace holds on vllm {d.version}: there is nothing to assert")
    if v.facts is None or v.facts.get("fact") not in FACTS:
        raise ExportError(f"property {v.prop} ({v.name}): this form does not state it yet")
    body = _steps(d.script[1:], v, at, trace, d)
    return (_module(trace, name, v, specs, body, d.version, _mode(d, trace),
                    older=found is not None and v.message == found[1]), utils_source())


def _mode(d: Any, trace: Trace) -> tuple[bool, int]:
    """Async scheduling and the pipeline-parallel size the driver runs the
    trace's depth with (0.33: async, and PP of depth - 1 beyond 2)."""
    _cls, async_, pp = d._depth_mode(trace.config.depth)
    return async_, pp


def _steps(script: list[tuple], v: Any, at: int, trace: Trace, d: Any) -> list[str]:
    f = v.facts
    cfg = trace.config
    B = cfg.block_size
    # the loading steps whose block ids a failed load names later
    tables = {e[1]: sorted(e[3]) for e in script if e[0] == "process" and e[3]}
    out: list[str] = []
    event = -1
    ran: list[str] = []  # the scheduler outputs named so far
    crash_at = None  # the index of the call that raised: the last of event ``at``
    if f["fact"] == "raises":
        crash_at = max(k for k, e in enumerate(script) if e[0] != "event")
    if f["fact"] == "stalls":  # its empty schedules are the assertion's
        empty = [k for k, e in enumerate(script) if e == ("schedule", None)][-f["idle"]:]
        script = [e for k, e in enumerate(script) if k not in empty]
    for k, e in enumerate(script):
        if k == crash_at:
            call = _call_line(e, tables)
            out += ["try:", f"    {call}", "    error = None",
                    f"except {f['error']} as e:", "    error = e"]
            break
        if e[0] == "event":
            event = e[1]
            if event == at and f["fact"].startswith("freed"):
                out.append(f"held = tables[{f['group']}].req_to_blocks[{f['rid']!r}]"
                           f"[{f['logical']}]")
            continue
        if e[0] == "add" and e[5]:  # the connector offers its external tokens
            out.append(f"scheduler.connector.offers[{e[1]!r}] = {e[5]}")
        if e[0] == "schedule":
            step = e[1]
            if step is None:
                out.append("scheduler.schedule()  # nothing to run")
                continue
            out.append(_call_line(e, tables))
            if step == f.get("step") and f["fact"] in ("reads_null", "reads_failed_load"):
                r = f["rid"]  # where it runs at all (a fix may have ended it)
                out += [f"start = None  # step {step} computes {r}'s [start, end)",
                        f"if {r!r} in s{step}.num_scheduled_tokens:",
                        f"    end = scheduler.requests[{r!r}].num_computed_tokens",
                        f"    start = end - s{step}.num_scheduled_tokens[{r!r}]"]
            for rid in tables.get(step, ()):
                out.append(f"ids{step} = scheduler.kv_cache_manager.get_block_ids("
                           f"{rid!r})[0]")
            ran.append(f"s{step}")
            if step == f.get("step") and f["fact"] == "sink_overwritten":
                out.append(f"table = scheduler.kv_cache_manager.get_block_ids("
                           f"{f['rid']!r})[{f['group']}]  # as step {step} writes")
            if step == f.get("step") and f["fact"] == "reads_draft_of_other":
                upto = ran[:ran.index(f"s{f['written_by']}") + 1]
                out += [f"mine = worker_block_ids([{', '.join(ran)}], {f['rid']!r})"
                        f"[{f['group']}]",
                        f"theirs = worker_block_ids([{', '.join(upto)}], {f['writer']!r})"
                        f"[{f['group']}]"]
            if step == f.get("step") and f["fact"] in ("state_clash", "state_slot_shared"):
                # the table the worker runs the step with: the outputs' block ids
                out.append(f"table = worker_block_ids([{', '.join(ran)}], {f['rid']!r})"
                           f"[{f['group']}]")
        elif e[0] == "drafts":
            out += _call_line(e, tables).splitlines()
        elif e[0] == "reset":  # the engine's utility call
            out.append(_call_line(e, tables))
        elif e[0] in ("add", "process", "finish"):
            if (e[0] == "process" and e[1] == f.get("step")
                    and f["fact"] == "output_counts_after_failed_read"):
                out += [f"req = scheduler.requests[{f['rid']!r}]  # held: it may finish",
                        "before = req.num_output_tokens"]
            out.append(_call_line(e, tables))
    out += _assertion(f, cfg, B, trace.events)
    # a step output nothing reads later is not named
    text = "\n".join(out)
    for i, ln in enumerate(out):
        name = ln.partition(" = scheduler.schedule()")[0]
        if name != ln and text.count(name) == 1:
            out[i] = "scheduler.schedule()"
    return out


def _call_line(e: tuple, tables: dict) -> str:
    """The one vLLM call of a script entry (the one that raised)."""
    if e[0] == "schedule":
        return f"s{e[1]} = scheduler.schedule()" if isinstance(e[1], int) \
            else "scheduler.schedule()"
    if e[0] == "process":
        _, step, sampled, failed = e
        got = {r: n for r, n in sampled.items() if n}
        fail = ""
        if failed:
            (_rid, slots), = failed.items()
            fail = f", failed=[{', '.join(f'ids{step}[{x}]' for x in slots)}]"
        return f"scheduler.update_from_output(s{step}, output(s{step}, {got!r}{fail}))"
    if e[0] == "add":
        var = f", variant={e[3]}" if e[3] else ""
        return f"scheduler.add_request(request({e[1]!r}, {e[2]}, {e[4]}{var}))"
    if e[0] == "finish":
        return f"scheduler.finish_requests({e[1]!r}, RequestStatus.{e[2]})"
    if e[0] == "drafts":  # the drafter's proposals on that output
        return f"propose(scheduler, {list(e[1])!r})"
    if e[0] == "reset":
        return "reset_prefix_cache(scheduler)"
    raise ExportError(f"a call of kind {e[0]} raised; not stated by this form")


def _read_blocks(cfg: Any, g: int, B: int, rid: str) -> str:
    """The logical blocks a step computing ``[start, end)`` reads (and
    writes), as a set expression, drawn per kind: an attention layer's
    positions ``range(lo, end)`` by block (R-SWA's whole prompt too); a Mamba
    layer's (``align`` mode) state after ``start - 1`` and state after
    ``end - 1``::

        B = 4, start = 4, end = 12   [ 0..3 | 4..7 | 8..11 ]
                                        in            out
    """
    grp = cfg.groups[g]
    if grp.kind == "mamba":
        return f"{{(end - 1) // {B}}} | ({{(start - 1) // {B}}} if start else set())"
    if grp.kind == "sliding":  # position t reads [t - W + 1, t]
        lo = f"max(0, start - {grp.param - 1})"
    elif grp.kind == "chunked_local":  # [t // C * C, t]
        lo = f"start // {grp.param} * {grp.param}"
    elif grp.kind == "rswa":  # [0, t] within the prompt P, then [0, P) and [t - R + 1, t]
        prompt = f"scheduler.requests[{rid!r}].num_prompt_tokens"
        return (f"{{q // {B} for q in range(max(0, start - {grp.param - 1}), end)}}"
                f" | {{q // {B} for q in range(min({prompt}, end))}}")
    else:  # full attention (a sink's too: its sink blocks are not in the table)
        lo = "0"
    return f"{{q // {B} for q in range({lo}, end)}}"


def _message(text: str, width: int = 64) -> list[str]:
    """An f-string message cut at spaces (never inside a replacement field)
    into pieces of at most about ``width`` characters, one line each."""
    words, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if ch == " " and depth == 0:
            words.append(cur + " ")
            cur = ""
        else:
            cur += ch
    words.append(cur)
    lines, line = [], ""
    for w in words:
        if line and len(line) + len(w) > width:
            lines.append(line)
            line = ""
        line += w
    lines.append(line)
    return [f'    f"{ln}"' if "{" in ln else f'    "{ln}"' for ln in lines]


def _assertion(f: dict, cfg: Any, B: int, events: list) -> list[str]:
    if f["fact"] == "raises":
        return ["assert error is None, (",
                *_message("vLLM raised {type(error).__name__}: {error}"), ")"]
    if f["fact"] == "stalls":
        n, rids = f["idle"], f["rids"]
        r = rids[0]
        return [
            f"outs = [scheduler.schedule() for _ in range({n})]",
            f"req = scheduler.requests[{r!r}]",
            "assert any(o.total_num_scheduled_tokens for o in outs), (",
            *_message(f"nothing is in flight and schedule() scheduled nothing {n} times "
                      f"in a row, while {r} has {{req.num_computed_tokens}} of "
                      f"{{req.num_tokens}} tokens computed ({{req.status.name}})"),
            ")",
        ]
    rid, fact = f["rid"], f["fact"]
    if fact == "copy_of_unfilled":
        s, lg = f["step"], f["logical"]
        if f.get("filled_later") == "forward" and not f["chained"]:
            g, Bg = f["group"], cfg.groups[f["group"]].block_size or B
            return [
                f"copies = s{s}.kv_cache_block_copies or []",
                "filled = set()  # the blocks the step's forward writes, per request",
                f"for r, n in s{s}.num_scheduled_tokens.items():",
                "    end = scheduler.requests[r].num_computed_tokens",
                f"    ids = scheduler.kv_cache_manager.get_block_ids(r)[{g}]",
                f"    filled.update(ids[(end - n) // {Bg} : -(-end // {Bg})])",
                "early = [tuple(c) for c in copies if c.src_block_id in filled]",
                "assert not early, (",
                *_message(f"step {s} copies (source, destination) {{early}} whose source "
                          f"the same step's forward fills: the model runner runs "
                          f"kv_cache_block_copies before the forward, so {rid}'s logical "
                          f"block {lg}, read by step {s}, gets what its source held "
                          f"before: nothing"),
                ")",
            ]
        if f.get("filled_later") == "load" and not f["chained"]:
            return [
                f"copies = s{s}.kv_cache_block_copies or []",
                f"loads = s{s}.kv_connector_metadata.blocks",
                "loading = {b for ids in loads.values() for group in ids for b in group}",
                "early = [tuple(c) for c in copies if c.src_block_id in loading]",
                "assert not early, (",
                *_message(f"step {s} copies (source, destination) {{early}} whose source "
                          f"its connector loads in the same step: the model runner runs "
                          f"kv_cache_block_copies before start_load_kv, so {rid}'s logical "
                          f"block {lg}, read by step {s}, gets what its source held "
                          f"before the load: nothing"),
                ")",
            ]
        if not f["chained"]:
            raise ExportError("a copy of a block nothing filled before the step: "
                              "not stated yet where no other copy or load was to fill it")
        return [
            f"copies = s{s}.kv_cache_block_copies or []",
            "filled = {c.dst_block_id for c in copies}",
            "chained = [tuple(c) for c in copies if c.src_block_id in filled]",
            "assert not chained, (",
            *_message(f"step {s} copies (source, destination) {{chained}} whose source "
                      f"another copy of the same step fills: the worker runs the copies "
                      f"as one gather, then one scatter, so {rid}'s logical block {lg}, "
                      f"read by step {s}, gets what its source held before: nothing"),
            ")",
        ]
    if fact == "reads_draft_of_other":
        lg, w, pos, key = f["logical"], f["writer"], f["position"], f["key"]
        prompts = {e.id: e.prompt_len for e in events if isinstance(e, AddRequest)}
        theirs = (f"{w}'s prompt token {key}" if key < prompts.get(w, 0) else
                  f"the token step {f['written_by']} samples for {w}")
        mine = (f"{rid}'s prompt token {key}" if key < prompts.get(rid, 0) else
                f"the token sampled for {rid}")
        return [
            f"shared = len(mine) > {lg} and len(theirs) > {lg} and mine[{lg}] == theirs[{lg}]",
            "assert not shared, (",
            *_message(f"step {f['step']} reads block {{mine[{lg}]}} as {rid}'s prefix "
                      f"(logical block {lg}), which step {f['written_by']} wrote for {w}: "
                      f"its EAGLE draft KV at position {pos} is built with the token at "
                      f"position {key}, {theirs}, not {mine}"),
            ")",
        ]
    if fact == "sink_overwritten":
        sink = f["sink"]
        first, last = sink[0], sink[-1]
        where = f"block {first}" if first == last else f"blocks {first}-{last}"
        return [
            f"handed = sorted(set(table) & set(range({first}, {last + 1})))",
            "assert not handed, (",
            *_message(f"step {f['step']} writes {rid}'s KV into its block(s) {{handed}}, "
                      f"where the sink's attention keeps the sink's KV (physical {where}), "
                      f"which every step reads (step {f['read_by']} for "
                      f"{f['reader']})"),
            ")",
        ]
    if fact == "state_slot_shared":
        (r, o), s = f["slots"], f["step"]
        how = (f"step {f['by']}'s postprocess copied the state after position {f['held']}"
               if f["copied"] else f"step {f['by']} wrote its state after {f['held']}")
        return [
            f"shared = len(table or ()) > {max(r, o)} and table[{r}] == table[{o}] != 0",
            "assert not shared, (",
            *_message(f"step {s} starts {rid} from the Mamba state after position "
                      f"{f['after']} at slot {r} of its block table, block {{table[{r}]}}, "
                      f"which the table also names at slot {o}, where {how}"),
            ")",
        ]
    if fact == "state_clash":
        (a, b), (x, y), i = f["slots"], f["positions"], f["accepted"]
        return [
            f"clash = len(table or ()) > {b} and table[{a}] == table[{b}] != 0",
            "assert not clash, (",
            *_message(f"step {f['step']} writes {rid}'s Mamba states after positions {x} "
                      f"and {y} into slots {a} and {b} of its block table, both block "
                      f"{{table[{a}]}}: the next step starts from the first if {i} draft(s) "
                      f"are accepted, and the block holds the second"),
            ")",
        ]
    if fact in ("freed_while_read", "freed_before_settled"):
        lg = f["logical"]
        why = (f"while step {f['step']}, still in flight, reads position {f['position']}"
               if fact == "freed_while_read" else
               f"while a rollback to its settled count {f['settled']} reads it")
        return [
            f"now = tables[{f['group']}].req_to_blocks[{rid!r}][{lg}]",
            "assert now is held and held.ref_cnt > 0, (",
            *_message(f"{rid}'s block {{held.block_id}} (logical {lg}, positions "
                      f"[{lg * B}, {(lg + 1) * B})) was freed {why}"),
            ")",
        ]
    if fact == "reads_null":
        s, g = f["step"], f["group"]
        if cfg.groups[g].retained:  # the lookahead reads below the window too
            raise ExportError("reads of a sliding window with retained tokens are not "
                              "stated yet")
        return [
            f"table = tables[{g}].req_to_blocks.get({rid!r}, [])",
            f"read = set() if start is None else {_read_blocks(cfg, g, B, rid)}",
            "null = sorted(lg for lg in read if table[lg].is_null)",
            "assert not null, (",
            *_message(f"step {s} computes {rid}'s positions [{{start}}, {{end}}), whose "
                      + ("Mamba state is read from or written to"
                         if cfg.groups[g].kind == "mamba" else "windows read")
                      + f" logical block(s) {{null}}: {rid}'s block table maps them to "
                      f"the NULL block"),
            ")",
        ]
    s = f["step"]
    if fact == "output_counts_after_failed_read":
        lg, x, y = f["logical"], f["bad_from"], f["bad_to"]
        return [
            "assert req.num_output_tokens == before, (",
            *_message(f"{rid}'s output of step {s} counts (it took the sampled token), "
                      f"but step {s} read {rid}'s logical block {lg} (positions [{x}, {y})), "
                      f"whose connector load failed in that same output"),
            ")",
        ]
    return [
        f"assert start is None or start <= {f['bad_from']}, (",
        *_message(f"step {s} computes {rid} from position {{start}} and reads positions "
                  f"[{f['bad_from']}, {f['bad_to']}), whose connector load failed and which "
                  f"no step computed again"),
        ")",
    ]


def _module(trace: Trace, name: str, v: Any, specs: dict[str, Any], body: list[str],
            version: str, mode: tuple[bool, int], build_raises: str = "",
            older: bool = False) -> str:
    """The test module; ``mode``: async scheduling and the pipeline-parallel
    size that keep the trace's depth of batches in flight; ``build_raises``:
    the error building the scheduler raises (the test asserts that it builds)."""
    cfg = trace.config
    async_, pp = mode
    finishes = any("RequestStatus." in ln for ln in body)
    classes = sorted({type(s).__name__ for s in specs.values()})
    spec_lines = [f"    {n!r}: {_spec_code(s)}," for n, s in specs.items()]
    policy = (repr(cfg.kv_load_failure_policy) if cfg.hazard == "unordered" else None)
    meta = trace.meta
    title = str(meta.get("title") or f"property {v.prop} ({v.name}) fails"
                if v.prop else meta.get("title") or "vLLM raises")
    doc = _wrap(f"{title[:1].upper()}{title[1:]}.")
    found = f"vLLM raises {v.message}" if v.facts.get("fact") == "raises" else str(v)
    where, on = _where(str(meta.get("target") or f"vllm@{version}"), version)
    if older:  # found on an older release; this one holds
        doc += [""] + _wrap(f"Found by kvcheck on {where} (its trace: {name}.json): "
                            f"{found}. These calls speak vllm {version}'s API; they hold "
                            f"there, and the assertion fails on a tree with the bug.")
    else:
        doc += [""] + _wrap(f"Found by kvcheck on {where} (its trace: {name}.json); "
                            f"these calls, replayed on {on}: {found}")
    if meta.get("fixed_by"):
        doc += passes_with(meta["fixed_by"])
    torch_used = any("torch." in ln for ln in spec_lines)
    helpers = [f for f in ("attention", "build", "output", "propose", "reset_prefix_cache",
                           "worker_block_ids")
               if any(f"{f}(" in ln for ln in body + spec_lines) or f == "build"]
    head = [
        "# SPDX-License-Identifier: Apache-2.0",
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
        '"""' + doc[0], *doc[1:], '"""', "",
        "import pytest",
        *(["import torch"] if torch_used else []),
        "",
        f"from vllm.v1.kv_cache_interface import {', '.join(classes)}",
        *(["from vllm.v1.request import RequestStatus"] if finishes else []),
        "",
        f"from kvcheck_utils import {', '.join(helpers)}",
        "",
        "pytestmark = pytest.mark.cpu_test",
        "",
        "",
        f"def test_{_identifier(name)}(tmp_path):",
        *(["    layers = {" + spec_lines[0].strip().rstrip(",") + "}"] if len(spec_lines) == 1
          else ["    layers = {", *spec_lines, "    }"]),
    ]
    # build()'s arguments, those at its defaults left out (kvcheck_utils.build)
    args = [f"num_blocks={cfg.num_blocks}", f"block_size={cfg.block_size}",
            f"max_num_batched_tokens={cfg.max_num_batched_tokens}",
            f"max_model_len={cfg.max_model_len}"]
    optional = [("max_num_seqs", cfg.max_num_seqs, 4), ("async_scheduling", async_, False),
                ("prefix_caching", bool(cfg.prefix_caching), False),
                ("load_failure_policy", policy, None),
                ("mamba_cache_mode", '"align"' if any(g.kind == "mamba" for g in cfg.groups)
                 else '"none"', '"none"'),
                ("pipeline_parallel_size", pp, 1),
                ("prefix_match_unit", cfg.prefix_match_unit or None, None),
                ("num_speculative_tokens", cfg.spec_tokens, 0),
                ("drafter", repr(cfg.drafter) if cfg.spec_tokens and cfg.drafter in
                 ("eagle", "mtp") else None, None)]
    args += [f"{k}={v}" for k, v, default in optional if v != default]
    call = [f"scheduler, request = build(tmp_path, layers, {', '.join(args)})"]
    if build_raises:  # vLLM cannot build the scheduler of these layers
        call[0] = call[0].removeprefix("scheduler, request = ")
        call = ["try:", *(f"    {ln}" for ln in call), "    error = None",
                f"except {build_raises} as e:", "    error = e"]
    head += [f"    {ln}" for ln in call]
    if any("tables[" in ln for ln in body):
        head.append("    tables = scheduler.kv_cache_manager.coordinator.single_type_managers")
    return "\n".join(head + [f"    {ln}" for ln in body]) + "\n"


def _where(target: str, version: str) -> tuple[str, str]:
    """Where the trace was found and where its calls were replayed, as a
    reader elsewhere can name them: a checkout's path says nothing there; a
    release with diffs names them (those under the repository by their path)."""
    from .overlay import series

    engine, _, rest = target.partition("@")
    release, plus, fix = rest.partition("+")
    if "/" in release:
        return f"a vLLM tree of the {version} line", "that tree"
    if not plus:
        return target, f"vllm {version}"
    root = str(Path(__file__).resolve().parent.parent.parent) + "/"
    diffs = [d.removeprefix(root) for d in series(fix)]
    return f"{engine}@{release} with {' and '.join(diffs)} applied", "that tree"


def _wrap(text: str, width: int = 76) -> list[str]:
    """Docstring lines; names with hyphens (traces, diffs) stay whole."""
    return textwrap.wrap(text, width, break_on_hyphens=False)


def passes_with(fixed_by: str, width: int = 76) -> list[str]:
    """The docstring's line on the fix: one diff, or a series a line each."""
    from .overlay import series

    parts = series(fixed_by)
    if len(parts) == 1:
        return _wrap(f"Passes with {parts[0]} applied.", width)
    return ["Passes with these diffs applied in turn:", *(f"    {d}" for d in parts)]


def _identifier(name: str) -> str:
    import re

    s = re.sub(r"\W+", "_", name).strip("_").lower()
    return s if s and not s[0].isdigit() else f"t_{s}"


# ------------------------------------------------------------ the main process


def step_form(trace: Trace, name: str) -> tuple[str, str]:
    """(test, kvcheck_utils.py), made beside the vLLM the trace shows on where
    that speaks 0.33's API, else beside vllm@0.33.0, formatted as vLLM
    formats its tests (ruff format, 88 columns)."""
    import re

    from properties.jobs import WorkerGone, _call

    target = str(trace.meta.get("target") or "vllm@0.33.0")
    found = None
    if not re.match(r"vllm@(0\.33\.|[^0-9])", target):
        # an older release: its violation, asserted in 0.33's API
        from properties.replay import replay

        rr = replay(trace, target)
        if rr.first is not None and not rr.crash:
            at = next(i for i, row in enumerate(rr.rows) if row.violations)
            found = (rr.first.prop, rr.first.message, rr.first.facts, at)
        target = "vllm@0.33.0"
    try:
        text, utils = _call(target, 0, "impl.vllm.export_steps:export_job",
                            (trace, name, found))
    except WorkerGone as e:
        raise ExportError(f"the replay on {target} crashed: "
                          f"{str(e).strip().splitlines()[-1]}") from None
    return formatted(text), formatted(utils)


FORMS = ("auto", "steps", "replaying")


def export(trace: Trace, name: str, form: str = "auto") -> tuple[str, tuple[str, str], str]:
    """(test, (its helper module's file name, its text), why the step form was
    not used or ""). ``form``: ``steps`` (vLLM's calls one by one, beside
    ``kvcheck_utils.py``, or ExportError), ``replaying`` (the trace replayed
    by ``kvcheck_replay.py``), ``auto``: the step form where it states the
    trace. A step-form test asserts the fact at the step that breaks; where a
    fix repairs the state in an earlier step than the one the assertion reads
    (a failed load recomputed before a later step reads it), the replaying
    form, which checks every step, is the one that passes on the fix."""
    from impl.vllm import export as replaying

    why = "asked for the replaying form"
    if form != "replaying":
        try:
            text, utils = step_form(trace, name)
            return text, ("kvcheck_utils.py", utils), ""
        except ExportError as e:
            if form == "steps":
                raise
            why = str(e)
    try:
        return (formatted(replaying.vllm_test_source(trace, name)),
                (replaying.HELPER, formatted(replaying.replay_helper_source())), why)
    except replaying.ExportError as e:
        raise ExportError(f"{why}; {e}") from None


RUFF_CONFIG = Path(__file__).resolve().parent / "vllm-test-ruff.toml"


def formatted(text: str) -> str:
    """The imports sorted and the text formatted as vLLM's tests are (ruff,
    :data:`RUFF_CONFIG`: 88 columns, vllm first-party)."""
    import subprocess
    import sys

    ruff = str(Path(sys.executable).with_name("ruff"))
    for args in (["check", "--fix", "--select", "I", "--quiet"], ["format"]):
        try:
            r = subprocess.run([ruff, *args, "--config", str(RUFF_CONFIG), "-"], input=text,
                               capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return text
        if r.returncode == 0 and r.stdout:
            text = r.stdout
    return text
