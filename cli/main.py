"""The ``./kvcheck`` command line.

Exit status: 0 all properties hold, 1 a violation (counterexample printed and
saved as a trace), 2 bad input or usage (one clear line), 3 the target failed
or cannot run what was asked, 4 incomplete (the gate: rows not covered in the
budget), 128+N a signal (130 Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from cli.common import UsageError, remove_created, usable_out
from impl.target import TargetCrash, TargetError, Unsupported
from model.events import DRAFTERS, KINDS, MTP_MODULES, TraceError
from model.kinds import KINDS as KIND_CLASSES
from properties.database import DatabaseError
from properties.replay import InvalidEvent

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE, EXIT_TARGET = 0, 1, 2, 3
ALL_KINDS = (*KINDS, "hybrid")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2
        # a subcommand names itself ("kvcheck fuzz: ..."); the top level's
        # line already starts "kvcheck: error:"
        raise UsageError(message if self.prog == "kvcheck" else f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvcheck",
        description="Check the KV-cache block freeing logic of vLLM v1 (and our reference "
                    "manager) against the invariant: a block is freed only when it is outside "
                    "every unprocessed step's window and no rollback can make it needed again.",
        epilog="exit status: 0 hold, 1 violation, 2 bad input, 3 target failed, 4 incomplete",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)

    f = sub.add_parser(
        "fuzz", help="drive a target with the Hypothesis state machine",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./kvcheck fuzz --target reference --kind sliding --policy optimistic "
               "--depth 2\n  ./kvcheck fuzz --target vllm@0.25.1 --kind chunked_local --depth 2\n"
               "a violation saves <out>/<name>.json, <out>/<name>.png and <out>/test_<name>.py")
    f.add_argument("--target", default="reference",
                   help="reference | vllm@VERSION | vllm@PATH | sglang@VERSION (default reference)")
    f.add_argument("--kind", default="sliding", choices=ALL_KINDS)
    f.add_argument("--policy", default=None,
                   help="freeing policy of the reference target (default settled; vLLM targets "
                        "implement their own)")
    f.add_argument("--depth", type=int, default=None, help="steps in flight: 1 sync, 2 async, "
                   "3-4 pipeline parallel (default: drawn)")
    f.add_argument("--spec-tokens", type=int, default=None, help="draft tokens per decode "
                   "(default: drawn 0-3)")
    f.add_argument("--drafter", choices=DRAFTERS, default="ngram",
                   help="how drafts are proposed: ngram (prompt lookup), eagle (vLLM's EAGLE: "
                        "a draft layer beside the first group, the hit's last block dropped or "
                        "hashes one token ahead; single-group kinds, vLLM targets) or mtp (a "
                        "multi-module MTP drafter of two modules: as eagle, drafts in pairs, "
                        "sliding windows retain spec_tokens - 1 tokens)")
    f.add_argument("--kv-load-failure-policy", choices=("recompute", "fail"),
                   default="recompute",
                   help="what a failed connector load does: recompute the request (default) "
                        "or end it with an error (vLLM's own default, FINISHED_ERROR)")
    f.add_argument("--hazard", choices=("ordered", "unordered"), default=None,
                   help="unordered: a KV-consumer connector may write freed blocks at once")
    f.add_argument("--prefix-caching", choices=("on", "off"), default=None)
    f.add_argument("--block-size", default=None, metavar="N|engine",
                   help="tokens per block (1, 2, 4, 8, 16 or 32; default: drawn from 16, 4 "
                        "and 8, small blocks whose edges short runs reach); engine (vLLM "
                        "targets): the sizes vLLM builds for published models, Mamba "
                        "hybrids padded to 80-544 (impl/vllm/layouts.py)")
    f.add_argument("--group-block-sizes", choices=("uniform", "mixed"), default="uniform",
                   help="mixed (--kind hybrid): groups of 1, 2 or 4 times the block size, as "
                        "vLLM plans layers whose pages differ; prefix hashes are then finer "
                        "than some groups' blocks")
    f.add_argument("--prefix-match-unit", choices=("block", "fine"), default="block",
                   help="fine (--kind hybrid): full attention beside Mamba hashed at B/2 or "
                        "B/4 tokens (vLLM's prefix_match_unit), where prefix hits end inside "
                        "a block and are served from a copy of it")
    f.add_argument("--no-external", action="store_true",
                   help="no connector-loaded tokens (and so no failed loads)")
    f.add_argument("--unaligned-loads", action="store_true",
                   help="connectors may offer external token counts that end inside a block "
                        "(default: whole blocks, as block-granular connectors offer)")
    f.add_argument("--no-failed-loads", action="store_true",
                   help="connector loads never fail (to fuzz past a known failed-load finding)")
    f.add_argument("--examples", type=int, default=200)
    f.add_argument("--steps", type=int, default=None,
                   help="events per example at most (default 30; 50 for rswa)")
    f.add_argument("--seed", type=int, default=None,
                   help="seed of the first run (the others take seed+1, seed+2, ...)")
    f.add_argument("--workers", type=int, default=None, metavar="N",
                   help="Hypothesis runs at once, each in its own process beside the target, "
                        "with its own seed, the examples shared out (default: one per core)")
    f.add_argument("--db", default=None,
                   help="Hypothesis example database directory, shared by the runs (failures "
                        "replay first)")
    f.add_argument("--out", default="counterexamples",
                   help="where counterexample traces are saved (default counterexamples/)")
    f.add_argument("--attention-every", type=int, default=0, metavar="N",
                   help="also confirm every Nth example numerically with attention replay")
    f.add_argument("--props", default="1,2,3,4,5,6,7", metavar="LIST",
                   help="the properties to enforce, e.g. 2 to look for null reads past "
                        "freed-while-read (default all)")
    f.add_argument("--base", default=None, metavar="TARGET",
                   help="replay a counterexample on this base too (vllm@VERSION, vllm@PATH): "
                        "introduced (fails on the target only: exit 1 / 3) or also on the "
                        "base (pre-existing: exit 0), as the gate attributes it")
    f.add_argument("--quiet", action="store_true")
    f.add_argument("--json", default=None, metavar="PATH",
                   help="also write the run's result to PATH as JSON (an existing file is "
                        "replaced atomically, as pytest writes --junitxml): verdict, "
                        "property, counterexample length, message, witnesses, examples, trace")
    f.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                   help="after a violation also write <out>/<name>.png (blocks against events) "
                        "and <out>/test_<name>.py (a standalone pytest reproducer); default on")

    r = sub.add_parser(
        "replay", help="re-run a saved trace on a target",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./kvcheck replay counterexamples/sliding-optimistic.json "
               "--target vllm@0.33.0 --attention")
    r.add_argument("trace")
    r.add_argument("--target", default=None,
                   help="default: the trace's own target, else reference")
    r.add_argument("--policy", default=None, help="override the trace's policy (reference)")
    r.add_argument("--attention", action="store_true",
                   help="also replay through real attention (CUDA where present, else CPU)")
    r.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    r.add_argument("--props", default=None, metavar="LIST",
                   help="check only these properties (e.g. 1,2; default all: a trace's "
                        "meta.props never narrows a replay)")
    r.add_argument("--base", default=None, metavar="TARGET",
                   help="replay the trace on this base too: introduced (fails on the target "
                        "only: exit 1 / 3), also on the base (exit 0), fixed by the target "
                        "(fails on the base only: exit 0)")
    r.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                   help="after a violation write counterexamples/<name>.png and "
                        "counterexamples/test_<name>.py (a pytest reproducer); default on")

    pr = sub.add_parser(
        "prove", help="prove the invariant with Z3; refute broken policies",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./kvcheck prove --kind sliding --policy settled")
    pr.add_argument("--kind", default=None, choices=(*KINDS,))
    pr.add_argument("--policy", default=None)
    pr.add_argument("--out", default="counterexamples")

    d = sub.add_parser(
        "diff", help="run one trace on two targets; report the first disagreement",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./kvcheck diff counterexamples/x.json --left reference "
               "--right vllm@0.33.0")
    d.add_argument("trace")
    d.add_argument("--left", default="reference")
    d.add_argument("--right", default="vllm@0.33.0")
    d.add_argument("--physical", action="store_true", help="compare physical block ids too")

    from cli.gate import add_merge_parser
    from cli.gate import add_parser as add_gate

    add_gate(sub)
    add_merge_parser(sub)
    from gate.nightly import EPILOG as NIGHTLY_EPILOG
    from gate.nightly import add_arguments as add_nightly

    n = sub.add_parser(
        "nightly", help="the nightly fuzz job: the whole matrix over a persistent database",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=NIGHTLY_EPILOG)
    add_nightly(n)
    e = sub.add_parser(
        "export", help="write a trace as a standalone pytest module in vLLM's test style",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./kvcheck export findings/01-failed-load-recompute-reads-null/"
               "failed-load-recompute-reads-null-sliding.json "
               "--vllm-test test_null_read.py\nthe test makes vLLM's calls one by one "
               "(schedule(), update_from_output(), ...) and asserts on vLLM's objects at the "
               "step that breaks; its helpers go beside it (kvcheck_utils.py). What that form "
               "does not state yet (KV content facts, properties 3-6) "
               "is written as a replay of the trace. Needs vLLM (0.33 line) and pytest only")
    e.add_argument("trace")
    e.add_argument("--vllm-test", required=True, metavar="OUT.py",
                   help="the module to write (never over an existing file)")
    e.add_argument("--form", choices=("auto", "steps", "replaying"), default="auto",
                   help="steps: vLLM's calls one by one, asserting at the step that breaks "
                        "(refused where it cannot state the trace); replaying: the trace "
                        "replayed and every step checked (what passes on a fix that repairs "
                        "the state before the step the step form reads); auto (default): "
                        "steps where it can")

    c = sub.add_parser(
        "check", help="the main job: prove, fuzz every kind, replay attention; a verdict table",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./kvcheck check --examples 300")
    c.add_argument("--target", default="reference")
    c.add_argument("--examples", type=int, default=300)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="reports",
                   help="check.md and the traces go into a fresh OUT/check/<time>/, "
                        "OUT/check/latest points at it")
    c.add_argument("--skip", action="append", default=[],
                   choices=("prove", "fuzz", "attention", "power"),
                   help="leave a part out (repeatable)")
    return p


# --------------------------------------------------------------------- fuzz


def _summary(res, verbose: bool = True, asked: int | None = None) -> str:
    st = res.stats
    runs = getattr(res, "workers", 1)
    lines = [f"target {res.spec.target}  kind {res.spec.kind}  policy {res.spec.policy}  "
             f"examples {st.examples}  {res.seconds:.1f}s"
             + (f"  ({runs} runs at once)" if runs > 1 else "")]
    if asked is not None and st.examples > asked and res.verdict == "holds":
        lines.append(f"({st.examples - asked} examples beyond --examples {asked}: Hypothesis "
                     f"does not count an example that ends, before its step limit, in a state "
                     f"no event can follow)")
    ev = ", ".join(f"{k} {v}" for k, v in sorted(st.events.items()))
    lines.append(f"events: {ev or 'none'}")
    if st.refused:
        lines.append("refused by the target (examples dropped): "
                     + ", ".join(f"{k} {v}" for k, v in sorted(st.refused.items())))
    if len(st.layouts) > 1:  # several group mixes drawn (hybrid): examples run per mix
        lines.append("layouts: " + ", ".join(f"{k} {v}" for k, v in sorted(st.layouts.items())))
    if verbose:
        from properties.invariants import WITNESSES

        wl = ", ".join(f"{k} {st.witness.get(k, 0)}" for k in WITNESSES)
        lines.append(f"witnesses: {wl}")
    for w, why in sorted(st.unrequired.items()):
        lines.append(f"not required of {res.spec.target}: {w} ({why})")
    return "\n".join(lines)


def cmd_fuzz(a) -> int:
    from properties.jobs import default_workers, replay_beside, run_fuzz
    from properties.machine import FuzzSpec
    from properties.replay import format_timeline

    policy = "settled" if a.policy is None else a.policy
    spec = FuzzSpec(target=a.target, kind=a.kind, policy=policy, depth=a.depth,
                    spec_tokens=a.spec_tokens, drafter=a.drafter, hazard=a.hazard,
                    prefix_caching=None if a.prefix_caching is None else a.prefix_caching == "on",
                    block_size=_block_size(a.block_size),
                    layout="engine" if a.block_size == "engine" else "small",
                    external=not a.no_external, max_steps=a.steps,
                    props=_parse_props(a.props), fail_loads=not a.no_failed_loads,
                    aligned_loads=not a.unaligned_loads, block_sizes=a.group_block_sizes,
                    match_unit=a.prefix_match_unit,
                    load_failure=a.kv_load_failure_policy)
    _validate_spec(spec, a)
    workers = default_workers() if a.workers is None else a.workers
    if workers < 1:
        raise UsageError(f"--workers {workers}: must be at least 1")
    workers = min(workers, a.examples)
    usable_out(a.out)
    if a.json is not None:
        _usable_json(a.json)
    db_path = None
    if a.db is not None:
        from properties.database import open_database

        open_database(a.db)  # refused here (exit 2) rather than in every worker
        db_path = str(Path(a.db).resolve())
    from impl.target import make_target

    target = make_target(a.target)
    _check_capabilities(target, spec)
    base = _base_of(a)
    progress = None
    if not a.quiet:
        from report.progress import Progress

        progress = Progress(f"fuzz {a.target} {a.kind}/{spec.policy}"
                            + (f" x{workers}" if workers > 1 else ""))
    try:
        res = run_fuzz(spec, a.examples, workers=workers, seed=a.seed, db_path=db_path,
                       attention_every=a.attention_every,
                       on_progress=progress.set if progress is not None else None)
    finally:
        if progress is not None:
            progress.close()
    print(_summary(res, asked=a.examples))
    verdict = res.verdict  # the one verdict of a fuzz run (FuzzResult.verdict)
    if res.attention is not None:
        checked, missed = res.attention
        print(f"attention: {checked} examples replayed numerically, "
              f"{len(missed)} where attention saw a bad read the checker did not")
    if verdict == "missed":
        trace, first_bad = res.attention[1][0]
        path = save_trace(trace, Path(a.out), f"attention-missed-{a.kind}.json")
        print(first_bad)
        print(f"verdict: CHECKER MISSED A BAD READ (trace saved: {path})")
        _write_json(a.json, res.to_json(trace_path=str(path)))
        return EXIT_VIOLATION
    if verdict == "crashed":
        path = save_trace(res.trace, Path(a.out), f"crash-{a.kind}.json") if res.trace else None
        print("verdict: TARGET FAILED")
        print(res.crash)
        _say_known(res, a.target)
        if path:
            print(f"trace saved: {path} ({len(res.trace.events)} events, the last one the "
                  f"event the target failed on)")
        pre = _say_on_base(res, base)
        _write_json(a.json, _attributed(res.to_json(trace_path=str(path) if path else None),
                                        base, pre))
        return EXIT_OK if pre else EXIT_TARGET
    if verdict == "violation":
        name = f"{a.target.replace('@', '-').replace('/', '_')}-{a.kind}-{spec.policy}"
        narrowed = spec.props if len(spec.props) < 7 else None
        rr = replay_beside(res.trace, a.target, narrowed)  # the shrunk trace, as it is saved
        v = rr.first or res.violation
        print(f"verdict: VIOLATION of property {v.prop} ({v.name}) "
              f"after shrinking to {len(res.trace.events)} events")
        print(format_timeline(rr))
        _say_known(res, a.target)
        rep = _save_counterexample(rr, Path(a.out), name, a.target, a.report)
        print(f"trace saved: {rep.trace}")
        print(f"replay: ./kvcheck replay {rep.trace} --target {a.target}")
        _print_report_paths(rep)
        pre = _say_on_base(res, base)
        _write_json(a.json, _attributed(res.to_json(violation=v, trace_path=str(rep.trace)),
                                        base, pre))
        return EXIT_OK if pre else EXIT_VIOLATION
    _write_json(a.json, res.to_json())
    if verdict == "vacuous":
        print(f"verdict: VACUOUS (never reached: {', '.join(res.vacuous)})")
        return EXIT_VIOLATION
    print("verdict: all properties hold")
    return EXIT_OK


def _base_of(a):
    """``--base``, checked before any run (gate.base.given_base): None without one."""
    if a.base is None:
        return None
    if not a.base.strip():
        raise UsageError("--base '': name a target (vllm@VERSION, vllm@PATH)")
    from gate.base import given_base

    return given_base(a.target, a.base)


def _say_on_base(res, base) -> bool:
    """With ``--base``: the counterexample replayed on the base, said in one
    line (gate.attribution); True where the base fails the same way."""
    if base is None:
        return False
    from gate.attribution import replay_on_base

    on = replay_on_base(res, base)
    if base.same:
        print(f"base {base.target}: the target's own tree, nothing can be introduced")
    elif on.fails:
        print(f"also on base {base.target}: it fails the same way there (pre-existing, "
              f"not the target's change; exit 0)")
    else:
        print(f"introduced: the base {base.target} holds on it"
              + (f" ({on.note})" if on.note else ""))
    return on.fails


def _attributed(result: dict, base, pre: bool) -> dict:
    """The --json result with the base's word: ``attribution`` is
    ``introduced`` or ``on base`` (absent without --base)."""
    if base is not None:
        result.update(base=base.target, attribution="on base" if pre else "introduced")
    return result


def _say_fixed(trace, base) -> None:
    """A trace that holds on the target, replayed on the base: fixed by the
    target where the base fails on it."""
    from gate.attribution import _crash_text, _replay

    rb = _replay(trace, base.target)
    if rb.crash is not None:
        print(f"fixed by the target: the base {base.target} crashes on it "
              f"({_crash_text(rb.crash)})")
    elif rb.first is not None:
        print(f"fixed by the target: the base {base.target} violates property "
              f"{rb.first.prop} ({rb.first.name}) on it")
    else:
        print(f"the base {base.target} holds on it too")


def _say_known(res, target: str) -> None:
    """Name the counterexample where it is a known finding (gate/known.py):
    by its shape, or on the finding's release by the fix that clears it."""
    from gate.known import by_name, known_findings, name_of
    from impl.vllm.compat import parse_release

    findings = known_findings()
    engine, _, version = target.partition("@")
    release = version if engine == "vllm" and parse_release(version) else None
    known, how = name_of(res, findings, release, any_text=False)
    if known is not None:
        f = by_name(known, findings)
        where = f.path.relative_to(f.path.parents[2]) if f.path is not None else known
        print(f"known: {f.label}{how}: a bug already on file ({where})")
    _say_layout(res.trace, target)


def _say_layout(trace, target: str) -> None:
    """Say where the counterexample's layout is one no published model builds."""
    from impl.target import layout_note

    note = layout_note(target, trace.config) if trace is not None else None
    if note:
        print(note)


def _usable_json(path: str) -> None:
    """Refuse a ``--json`` path that cannot be written before the run
    (exit 2); an existing file is replaced atomically at the end, as pytest
    writes ``--junitxml`` (report.output)."""
    from report.output import OutputError, check_named_file

    try:
        check_named_file(path, "--json")
    except OutputError as e:
        raise UsageError(str(e)) from None


def _write_json(path: str | None, result: dict) -> None:
    if path is None:
        return
    from report.output import replace_file

    replace_file(Path(path), json.dumps(result, indent=1) + "\n")


def _parse_props(text: str) -> frozenset[int]:
    try:
        props = frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--props {text!r}: a comma-separated list of 1-6") from None
    if not props or not props <= {1, 2, 3, 4, 5, 6, 7}:
        raise UsageError(f"--props {text!r}: a comma-separated list of 1-6")
    return props


def _validate_spec(spec, a) -> None:
    from model.policy import REGISTRY

    if spec.policy not in REGISTRY:
        raise UsageError(f"unknown policy {spec.policy!r} (known: {', '.join(REGISTRY)})")
    if spec.depth is not None and not 1 <= spec.depth <= 4:
        raise UsageError(f"--depth {spec.depth}: must be 1 (sync), 2 (async) or 3-4 (PP)")
    if spec.spec_tokens is not None and not 0 <= spec.spec_tokens <= 8:
        raise UsageError(f"--spec-tokens {spec.spec_tokens}: must be 0-8")
    if spec.drafter != "ngram" and spec.spec_tokens == 0:
        raise UsageError(f"--drafter {spec.drafter} proposes drafts; --spec-tokens 0 contradicts")
    if spec.drafter == "mtp" and spec.spec_tokens is not None and spec.spec_tokens % MTP_MODULES:
        raise UsageError(f"--drafter mtp ({MTP_MODULES} modules): --spec-tokens must be a "
                         f"multiple of {MTP_MODULES}, got {spec.spec_tokens}")
    kind = KIND_CLASSES.get(spec.kind)
    if kind is not None and not kind.prefix_cacheable and spec.prefix_caching:
        raise UsageError(f"--prefix-caching on: {spec.kind} takes no prefix hits (vLLM's "
                         f"{kind.vllm_manager})")
    if kind is not None and not kind.reads_positions and a.attention_every > 0:
        raise UsageError(f"--attention-every: the attention replay reads positions' KV, and "
                         f"{spec.kind}'s blocks hold none")
    # vLLM plans the draft layer of a hybrid model as a group of its own; the
    # checker drives that beside Mamba (full + draft [+ sliding] + Mamba)
    if spec.drafter != "ngram" and (spec.kind == "hybrid" or (kind is not None and kind.beside)) \
            and (spec.kind != "hybrid" or spec.prefix_caching is False or spec.external
                 or spec.block_sizes != "uniform"):
        raise UsageError(f"--drafter {spec.drafter}: single attention groups, Mamba, or "
                         "--kind hybrid with Mamba (--prefix-caching on --no-external, "
                         "uniform block sizes): vLLM plans the draft layer of a hybrid "
                         "model as a group of its own, driven beside Mamba only")
    if spec.block_sizes != "uniform" and spec.kind != "hybrid":
        raise UsageError(f"--group-block-sizes {spec.block_sizes}: several groups only "
                         f"(--kind hybrid), got --kind {spec.kind}")
    if spec.match_unit != "block" and (spec.kind != "hybrid" or spec.prefix_caching is False
                                       or spec.drafter != "ngram"
                                       or spec.block_sizes != "uniform"
                                       or (spec.block_size or 4) < 4):
        raise UsageError(f"--prefix-match-unit {spec.match_unit}: --kind hybrid (full beside "
                         "Mamba) with prefix caching, n-gram drafts, uniform group block sizes "
                         "and a block size of 4 or more")
    if spec.block_size is not None and spec.block_size not in (1, 2, 4, 8, 16, 32):
        raise UsageError(f"--block-size {spec.block_size}: must be a power of two up to 32, "
                         "or engine")
    if spec.layout == "engine" and spec.block_sizes != "uniform":
        raise UsageError("--block-size engine: uniform group block sizes (the engine's sizes "
                         "are those of whole layouts)")
    if a.examples < 1 or (a.steps is not None and a.steps < 1):
        raise UsageError("--examples and --steps must be positive")
    if a.attention_every < 0:
        raise UsageError(f"--attention-every {a.attention_every}: must be >= 0 (0: never)")


def _block_size(text: str | None) -> int | None:
    """``--block-size``: a number, or None for ``engine`` and for none given."""
    if text is None or text == "engine":
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--block-size {text}: a number of tokens or engine") from None


def _check_capabilities(target, spec) -> None:
    from impl.target import fit_spec

    fit_spec(target.name, target.capabilities, spec)


def save_trace(trace, out: Path, filename: str) -> Path:
    """``trace`` saved as ``out/filename`` (never over a file); where ``out``
    cannot be written after all, in a new temporary folder, said in a line:
    a result found is never lost to its output folder."""

    try:
        return trace.save(Path(out) / filename)
    except OSError as e:
        alt = Path(tempfile.mkdtemp(prefix="kvcheck-"))
        print(f"cannot write in {out} ({e.strerror or e}); saving in {alt} instead")
        return trace.save(alt / filename)


def _save_counterexample(rr, out: Path, name: str, target: str, report: bool):
    """The trace, picture and reproducer under one fresh name in ``out``; where
    ``out`` cannot be written after all, in a new temporary folder (printed)."""

    from report.report import save_counterexample

    try:
        return save_counterexample(rr, out, name, target, report)
    except OSError as e:
        alt = Path(tempfile.mkdtemp(prefix="kvcheck-"))
        print(f"cannot write in {out} ({e.strerror or e}); saving in {alt} instead")
        return save_counterexample(rr, alt, name, target, report)


def _print_report(rr, out: Path, name: str, target: str, grid=None) -> None:
    """Write the counterexample's picture (from ``grid`` where drawn already)
    and pytest reproducer; print their paths."""
    from report.report import write_report

    _print_report_paths(write_report(rr, out, name, target, grid=grid))


def _print_report_paths(rep) -> None:
    if rep.png:
        print(f"picture: {rep.png}")
    if rep.reproducer:
        print(f"reproducer: {rep.reproducer}  (pytest it; KVCHECK_TARGET=... tries another "
              f"target)")
    for e in rep.errors:
        print(f"report: {e}")


# ------------------------------------------------------------------- replay


def cmd_replay(a) -> int:
    from dataclasses import replace as dc_replace

    from model.events import Trace
    from properties.jobs import replay_beside
    from properties.replay import format_timeline

    trace = Trace.load(a.trace)
    if a.policy is not None:
        from model.policy import REGISTRY

        if a.policy not in REGISTRY:
            raise UsageError(f"unknown policy {a.policy!r}")
        trace = Trace(dc_replace(trace.config, policy=a.policy), trace.events, trace.meta)
    if a.target is not None and not a.target.strip():
        raise UsageError("--target '': name a target (reference, vllm@VERSION, vllm@PATH, "
                         "sglang@VERSION)")
    target = a.target or trace.meta.get("target") or "reference"
    from impl.target import make_target

    make_target(target)  # an unknown target or vLLM: one line, before a worker starts
    a.target = target
    base = _base_of(a)
    # replayed and drawn beside the target: only the timeline and the picture's
    # grid come back, not a row per event
    props = _parse_props(a.props) if a.props is not None else None
    got = replay_beside(trace, target, props, job="report.report:replay_shown_job")
    rr, timeline, grid = got if isinstance(got, tuple) else (got, None, None)
    print(f"target {target}")
    if props is not None and props != frozenset(range(1, 8)):
        print(f"checking only properties {', '.join(map(str, sorted(props)))} (--props)")
    elif trace.meta.get("props") and set(trace.meta["props"]) != set(range(1, 8)):
        print(f"the run that found this trace checked only properties "
              f"{', '.join(map(str, sorted(trace.meta['props'])))} (meta.props); every "
              f"property is checked here (--props narrows)")
    print(timeline if timeline is not None else format_timeline(rr))
    code = EXIT_OK
    if rr.crash or rr.first is not None:
        from types import SimpleNamespace

        _say_known(SimpleNamespace(crash=rr.crash, violation=rr.first, trace=trace, spec=None),
                   target)
    if rr.crash:
        code = EXIT_TARGET
    elif rr.first is not None:
        print(f"verdict: VIOLATION of property {rr.first.prop} ({rr.first.name})")
        code = EXIT_VIOLATION
        if a.report:
            stem = Path(a.trace).stem + (f"-{a.policy}" if a.policy else "")
            if target != (trace.meta.get("target") or "reference"):
                stem += "-on-" + target.replace("@", "-").replace("/", "_")
            _print_report(rr, Path("counterexamples"), stem, target, grid)
    else:
        print(f"verdict: {rr.held()}")
    if base is not None:
        from types import SimpleNamespace

        if rr.crash or rr.first is not None:
            if _say_on_base(SimpleNamespace(crash=rr.crash, violation=rr.first, trace=trace,
                                            spec=None), base):
                code = EXIT_OK
        elif not base.same:
            _say_fixed(trace, base)
    if a.attention:
        from confirm.attention import format_report, replay_attention

        rep = replay_attention(trace, target_spec=target, dtype=a.dtype)
        print(format_report(rep))
        if not rep.ok and code == EXIT_OK:
            code = EXIT_VIOLATION
    return code


# ------------------------------------------------------------------- export


def cmd_export(a) -> int:
    from model.events import Trace

    out = Path(a.vllm_test)
    if out.suffix != ".py":
        raise UsageError(f"--vllm-test {a.vllm_test}: name a .py module")
    try:
        there = out.exists() or out.is_symlink()
    except OSError as e:  # a name too long, a folder that cannot be searched
        raise UsageError(f"--vllm-test {a.vllm_test}: cannot write there "
                         f"({e.strerror})") from None
    if there:
        raise UsageError(f"--vllm-test {a.vllm_test}: exists; kvcheck does not overwrite it")
    if not out.parent.is_dir():
        raise UsageError(f"--vllm-test {a.vllm_test}: no folder {out.parent}")
    trace = Trace.load(a.trace)
    from impl.vllm import export_steps

    try:  # the step form, else the replaying form for what it does not state yet
        text, (helper_name, utils), why = export_steps.export(trace, Path(a.trace).stem,
                                                              a.form)
    except export_steps.ExportError as e:
        raise UsageError(f"{a.trace} cannot be exported: {e}") from None
    helper = out.parent / helper_name
    if helper.exists() and helper.read_text() != utils:
        raise UsageError(f"{helper} exists and differs from the helpers this test needs; "
                         f"export into another folder or move it away")
    try:
        with open(out, "x") as f:
            f.write(text)
        if not helper.exists():
            with open(helper, "x") as f:
                f.write(utils)
    except OSError as e:
        raise UsageError(f"--vllm-test {a.vllm_test}: {e.strerror}") from None
    form = "" if not why else f" in the replaying form (the step form: {why})"
    print(f"wrote {out}{form} ({len(text.splitlines())} lines; its helpers: {helper})")
    print(f"run: pytest {out}")
    return EXIT_OK


# --------------------------------------------------------------------- diff


def cmd_diff(a) -> int:
    from confirm.differential import diff
    from model.events import Trace

    trace = Trace.load(a.trace)
    diffs, n = diff(trace, a.left, a.right, physical=a.physical)
    if diffs:
        print(f"{a.left} and {a.right} disagree after {n} of {len(trace.events)} events:")
        print(diffs[0])
        return EXIT_VIOLATION
    print(f"{a.left} and {a.right} agree on all {n} events")
    return EXIT_OK


# -------------------------------------------------------------------- prove


def cmd_prove(a) -> int:
    from prove import proof

    kinds = [a.kind] if a.kind else None
    policies = [a.policy] if a.policy is not None else None
    if a.policy is not None:
        from model.policy import REGISTRY

        if a.policy not in REGISTRY:
            raise UsageError(f"unknown policy {a.policy!r} (known: {', '.join(REGISTRY)})")
    usable_out(a.out)
    results = proof.prove_all(kinds=kinds, policies=policies)
    for r in results:
        if r.trace is not None:
            path = save_trace(r.trace, Path(a.out), f"prove-{r.kind}-{r.policy}.json")
            r.detail = (r.detail + f"; trace saved: {path}").strip("; ")
    print(proof.format_results(results))
    if not kinds and not policies:
        print(proof.format_bounds(proof.admission_bounds()))
    bad = [r for r in results if r.status == "unknown"
           or (r.status == "refuted" and r.policy == "settled")]
    return EXIT_VIOLATION if bad else EXIT_OK


# -------------------------------------------------------------------- check


def cmd_check(a) -> int:
    from cli.check import run_check

    if a.examples < 1:
        raise UsageError(f"--examples {a.examples}: must be positive")
    if a.seed < 0:
        raise UsageError(f"--seed {a.seed}: must be >= 0")
    if {"prove", "fuzz", "power", "attention"} <= set(a.skip):
        raise UsageError("--skip: every part is skipped; nothing would be checked")
    from impl.target import make_target

    make_target(a.target)  # an unknown or missing target: one line, before any part runs
    usable_out(a.out)
    from report.output import OutputError

    try:
        return run_check(a)
    except OutputError as e:
        raise UsageError(str(e)) from None


def cmd_gate(a) -> int:
    from cli.gate import cmd_gate as run

    return run(a)


def cmd_nightly(a) -> int:
    from gate.nightly import cmd

    return cmd(a)


def cmd_merge(a) -> int:
    from cli.gate import cmd_merge as run

    return run(a)


def _check_environment() -> None:
    """The environment variables kvcheck reads, checked before anything runs
    (``KVCHECK_REDIS_URL`` is checked, and tried, where the database opens)."""
    import math

    v = os.environ.get("KVCHECK_VLLM_START_TIMEOUT")
    if v is not None:
        try:
            t = float(v)
        except ValueError:
            t = math.nan
        if not (math.isfinite(t) and t > 0):
            raise UsageError(f"KVCHECK_VLLM_START_TIMEOUT={v[:40]!r}: must be a number of "
                             f"seconds > 0")
    v = os.environ.get("KVCHECK_HANG_TIMEOUT")
    if v is not None:
        try:
            t = float(v)
        except ValueError:
            t = math.nan
        if not (math.isfinite(t) and t > 0):
            raise UsageError(f"KVCHECK_HANG_TIMEOUT={v[:40]!r}: must be a number of seconds > 0")
    from properties.database import open_database, redis_url

    if redis_url():  # a server that does not answer: exit 2, whatever the command
        open_database()


class Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled as Ctrl-C is (exit 128 + N)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame: object) -> None:
    raise Signalled(signum)


def _printable_streams() -> None:
    """Output any terminal encoding can print: what it cannot is escaped
    (a lone surrogate in a request id, non-ASCII under PYTHONIOENCODING=ascii)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(OSError, ValueError):
                reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    import signal

    _printable_streams()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread (a test)
            signal.signal(sig, _on_signal)
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
        _check_environment()
        if a.cmd is None:
            print(parser.format_usage().rstrip(), file=sys.stderr)
            print("kvcheck: error: name a command (fuzz, replay, gate, merge, nightly, check, "
                  "prove, diff, export); ./kvcheck -h for help", file=sys.stderr)
            return EXIT_USAGE
        return {"fuzz": cmd_fuzz, "replay": cmd_replay, "prove": cmd_prove, "diff": cmd_diff,
                "check": cmd_check, "gate": cmd_gate, "merge": cmd_merge, "nightly": cmd_nightly,
                "export": cmd_export}[a.cmd](a)
    except (UsageError, TraceError, Unsupported, DatabaseError) as e:
        print(f"kvcheck: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except InvalidEvent as e:  # a trace event the target's state does not allow
        print(f"kvcheck: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except TargetError as e:
        print(f"kvcheck: target failed: {e}", file=sys.stderr)
        return EXIT_TARGET
    except TargetCrash as e:
        print(f"kvcheck: target crashed:\n{e}", file=sys.stderr)
        return EXIT_TARGET
    except KeyboardInterrupt as e:
        from impl.worker import kill_all

        kill_all()  # the workers ended, their temporary files removed
        if isinstance(e, Signalled):
            name = signal.Signals(e.signum).name
            print(f"kvcheck: stopped by {name}", file=sys.stderr)
            return 128 + e.signum
        print("kvcheck: interrupted", file=sys.stderr)
        return 130
    finally:
        remove_created()


def run(argv: list[str]) -> int:
    """``./kvcheck``: :func:`main`, and a signal that lands after it has
    returned (as a run finishes) still ends with its line and 128 + N;
    the shutdown after it (workers closed) is not interrupted again."""
    import signal

    try:
        code = main(argv)
    except BrokenPipeError:  # the reader went away (| head): end as a pipe's writer does
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _quiet_exit(128 + signal.SIGPIPE)
    except KeyboardInterrupt as e:
        from impl.worker import kill_all

        kill_all()
        signum = e.signum if isinstance(e, Signalled) else signal.SIGINT
        said = ("interrupted" if signum == signal.SIGINT
                else f"stopped by {signal.Signals(signum).name}")
        print(f"kvcheck: {said}", file=sys.stderr)
        return _quiet_exit(128 + signum)
    # the workers closed here rather than at exit: a signal that lands while
    # they close is noted, not raised, and still ends the run with its line
    late: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: late.append(signum))
    _close_workers()
    if late:
        said = ("interrupted" if late[0] == signal.SIGINT
                else f"stopped by {signal.Signals(late[0]).name}")
        print(f"kvcheck: {said}", file=sys.stderr)
        code = 128 + late[0]
    return _quiet_exit(code)


def _close_workers() -> None:
    """Close every worker this process started (what exit would do)."""
    from impl.worker import shutdown_plain

    shutdown_plain()
    for mod, fn in (("impl.vllm", "_shutdown_all"), ("impl.sglang.target", "_shutdown")):
        m = sys.modules.get(mod)
        if m is not None:
            getattr(m, fn)()


def _quiet_exit(code: int) -> int:
    """Signals are ignored from here to the exit, which has nothing left to do."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return code
