#!/usr/bin/env python3
"""Mutation testing of the checker against the real vLLM (``make mutants``).

Each mutant is one small edit to vLLM 0.33.0's own freeing or accounting code,
the kind of slip a pull request could make: an off-by-one in a window, a
counter not reset, a fence one step early, a reference count not taken. For
each, a copy of the installed release with that one edit is fuzzed as a
source checkout (``--target vllm@PATH``) and the mutant must be *killed*: a
property names the step and the block. None of these edits is a bug the
checker was written against; they test the invariants, not known symptoms.
The unmodified copy is fuzzed the same way and must pass (the control row).

    .venv/bin/python scripts/mutants.py [--only NAME,...] [--examples N] [--list]

Writes ``reports/mutants.md`` and ``reports/mutants.json``; counterexample
traces go under ``reports/mutants/<name>/``. Exit status: 0 every mutant is
killed by a property it is expected to trip and the control passes, 1
otherwise, 2 bad usage or an anchor that no longer matches the release.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "0.33.0"
INSTALLED = ROOT / ".vllm" / RELEASE / "vllm"
CORE = "v1/core/"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the vllm/ package
    old: str  # must occur exactly once in the file
    new: str
    why: str  # the slip, in one line
    args: tuple[str, ...]  # fuzz options that reach the edited path
    expect: frozenset[int]  # the properties that should catch it
    # killed: a property in ``expect`` fires; crashed: vLLM's own assertion fires first
    # (kvcheck reports exit 3 with the trace); vacuous: the witnesses show the code never
    # reaches a free at all; survives: a harmless edit the checker must stay silent on
    outcome: str = "killed"


_ASYNC = ("--depth", "2")
_CONSUMER = ("--hazard", "unordered", "--depth", "2")

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "optimistic-basis", CORE + "kv_cache_manager.py",
        "max(0, total_computed_tokens - request.num_in_flight_tokens),",
        "total_computed_tokens,",
        "allocate_slots frees out-of-window blocks on the optimistic count again",
        ("--kind", "sliding", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "swa-window-one-short", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens",
        "sliding window's skipped-token count one too high (window of W-1)",
        ("--kind", "sliding", "--depth", "1"), frozenset({1, 2})),
    Mutant(
        "chunk-boundary-early", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens // self.attention_chunk_size\n        ) * self.attention_chunk_size",
        "(num_computed_tokens + 1) // self.attention_chunk_size\n"
        "        ) * self.attention_chunk_size",
        "chunked-local frees the current chunk one token before it ends",
        ("--kind", "chunked_local", "--depth", "1"), frozenset({1, 2})),
    Mutant(
        "mamba-frees-last-state", CORE + "single_type_kv_cache_manager.py",
        "need to keep the state of the last computed token, so we return\n"
        "        num_computed_tokens - 1.\n        \"\"\"\n        return num_computed_tokens - 1",
        "need to keep the state of the last computed token, so we return\n"
        "        num_computed_tokens - 1.\n        \"\"\"\n        return num_computed_tokens",
        "Mamba lets go of the state block of the last computed token",
        ("--kind", "mamba", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "hybrid-sliding-one-short", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens",
        "the same window slip, seen through a hybrid full + sliding model",
        ("--kind", "hybrid", *_ASYNC), frozenset({1, 2})),
    Mutant(
        "preempt-zeroes-in-flight", CORE + "sched/scheduler.py",
        "        request.status = RequestStatus.PREEMPTED\n"
        "        request.num_computed_tokens = 0\n",
        "        request.status = RequestStatus.PREEMPTED\n"
        "        request.num_computed_tokens = 0\n"
        "        request.num_in_flight_tokens = 0\n",
        "preemption resets the in-flight count while its steps are still in flight",
        ("--kind", "sliding", *_ASYNC), frozenset({4})),
    Mutant(
        "in-flight-drain-one-token", CORE + "sched/scheduler.py",
        "                request.num_in_flight_tokens -= num_tokens_scheduled\n",
        "                request.num_in_flight_tokens -= min(num_tokens_scheduled, 1)\n",
        "processing a step drains one in-flight token, not every token it scheduled",
        ("--kind", "sliding", *_ASYNC), frozenset({4})),
    Mutant(
        "deferred-free-off", CORE + "sched/scheduler.py",
        "            if multiple_inflight_batches and kv_transfer_config.is_kv_consumer:\n"
        "                self.defer_block_free = True\n",
        "            if multiple_inflight_batches and kv_transfer_config.is_kv_consumer:\n"
        "                self.defer_block_free = False\n",
        "a KV consumer under async scheduling no longer defers request-level frees",
        ("--kind", "full", *_CONSUMER), frozenset({1})),
    Mutant(
        "fence-one-step-early", CORE + "sched/scheduler.py",
        "            request.last_sched_seq <= self.processed_step_seq\n",
        "            request.last_sched_seq <= self.processed_step_seq + 1\n",
        "the deferred-free fence lets a request's blocks go one step early",
        ("--kind", "full", *_CONSUMER), frozenset({1})),
    Mutant(
        "preempt-skips-fence", CORE + "sched/scheduler.py",
        "        self._free_request_blocks(request)\n"
        "        self.encoder_cache_manager.free(request)\n"
        "        self._pending_encoder_input_ids.pop(request.request_id, None)\n"
        "        self._inflight_prefills.discard(request)\n"
        "        request.status = RequestStatus.PREEMPTED\n",
        "        self.kv_cache_manager.free(request)\n"
        "        self.encoder_cache_manager.free(request)\n"
        "        self._pending_encoder_input_ids.pop(request.request_id, None)\n"
        "        self._inflight_prefills.discard(request)\n"
        "        request.status = RequestStatus.PREEMPTED\n",
        "preemption returns the blocks at once, past the deferred-free fence",
        ("--kind", "full", *_CONSUMER), frozenset({1})),
    Mutant(
        "cached-blocks-leak", CORE + "block_pool.py",
        "            block.ref_cnt -= 1\n            if block.ref_cnt == 0:\n"
        "                if block.block_hash is None or not self.enable_caching:",
        "            block.ref_cnt -= 1 if block.block_hash is None else 0\n"
        "            if block.ref_cnt == 0:\n"
        "                if block.block_hash is None or not self.enable_caching:",
        "freeing a prefix-cached block forgets to drop its reference",
        ("--kind", "full", "--prefix-caching", "on", *_ASYNC), frozenset({3})),
    Mutant(
        "prefix-hit-no-ref", CORE + "block_pool.py",
        "                self.free_block_queue.remove(block)\n            block.ref_cnt += 1\n"
        "            if self.metrics_collector:\n"
        "                self.metrics_collector.on_block_accessed(block)",
        "                self.free_block_queue.remove(block)\n"
        "            block.ref_cnt += 1 if block.ref_cnt == 0 else 0\n"
        "            if self.metrics_collector:\n"
        "                self.metrics_collector.on_block_accessed(block)",
        "a prefix-cache hit on a block already in use takes no reference",
        ("--kind", "full", "--prefix-caching", "on", *_ASYNC), frozenset({1, 2, 3})),
    Mutant(
        "skipped-blocks-round-up", CORE + "single_type_kv_cache_manager.py",
        "        num_skipped_blocks = num_skipped_tokens // self.block_size\n"
        "        # `num_skipped_tokens` may include",
        "        num_skipped_blocks = -(-num_skipped_tokens // self.block_size)\n"
        "        # `num_skipped_tokens` may include",
        "the skipped-token count is rounded up to blocks, freeing a block still half in the window",
        ("--kind", "sliding", "--depth", "1"), frozenset({1, 2})),
    Mutant(
        "swa-window-one-long", CORE + "single_type_kv_cache_manager.py",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens",
        "num_computed_tokens - self.sliding_window - self.extra_retained_tokens",
        "sliding window keeps one token more than it reads: harmless, inside vLLM's pool sizing",
        ("--kind", "sliding", *_ASYNC), frozenset(), "survives"),
    Mutant(
        "rejection-not-rolled-back", CORE + "sched/scheduler.py",
        "                        request.num_computed_tokens -= num_rejected\n",
        "                        request.num_computed_tokens -= 0\n",
        "rejected drafts are not rolled back from the computed count",
        ("--kind", "sliding", "--spec-tokens", "2", *_ASYNC), frozenset({1, 2, 4})),
    Mutant(
        "stale-share-forgotten", CORE + "sched/scheduler.py",
        "        request.num_stale_output_tokens = request.num_in_flight_tokens\n"
        "        request.num_output_placeholders = 0\n        request.num_preemptions += 1\n",
        "        request.num_stale_output_tokens = 0\n"
        "        request.num_output_placeholders = 0\n        request.num_preemptions += 1\n",
        "a preempted request's in-flight output is not marked stale",
        ("--kind", "sliding", "--spec-tokens", "2", *_ASYNC), frozenset(), "crashed"),
    Mutant(
        "window-never-frees", CORE + "single_type_kv_cache_manager.py",
        "        del num_prompt_tokens\n"
        "        # Remove the blocks that will be skipped during attention computation.\n"
        "        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)\n"
        "        if num_skipped_tokens <= 0:",
        "        del num_prompt_tokens\n"
        "        # Remove the blocks that will be skipped during attention computation.\n"
        "        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)\n"
        "        if True:",
        "out-of-window blocks are never freed (a request holds its whole history)",
        ("--kind", "sliding", *_ASYNC), frozenset(), "vacuous"),
)

CONTROL_ARGS = ("--kind", "sliding", *_ASYNC)
_VERDICT = re.compile(r"verdict: VIOLATION of property (\d) \(([^)]*)\) after shrinking to (\d+)")


@dataclass
class Row:
    name: str
    why: str
    args: list[str]
    wanted: str  # the outcome this row must have
    expect: list[int]
    outcome: str = ""  # killed | survived | crashed | vacuous | error
    prop: int | None = None
    prop_name: str = ""
    events: int | None = None
    seconds: float = 0.0
    message: str = ""
    trace: str = ""

    @property
    def ok(self) -> bool:
        if self.wanted == "survives":
            return self.outcome == "survived"
        if self.wanted == "killed":
            return self.outcome == "killed" and self.prop in self.expect
        return self.outcome == self.wanted


class AnchorError(Exception):
    pass


def mutant_tree(m: Mutant | None, dest: Path, source: Path = INSTALLED) -> Path:
    """A vLLM tree at ``dest/vllm``: symlinks to the installed release's files,
    except the one file the mutant edits, which is a real, edited copy."""
    if not (source / "__init__.py").is_file():
        raise AnchorError(f"vLLM {RELEASE} is not installed at {source}: "
                          f"run make vllm VLLM={RELEASE}")
    pkg = dest / "vllm"
    shutil.copytree(source, pkg, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if m is not None:
        text = (source / m.file).read_text()
        n = text.count(m.old)
        if n != 1:
            raise AnchorError(f"mutant {m.name}: its anchor occurs {n} times in {m.file} "
                              f"of vLLM {RELEASE} (expected once); update scripts/mutants.py")
        (pkg / m.file).unlink()
        (pkg / m.file).write_text(text.replace(m.old, m.new))
    return dest


def run_one(m: Mutant | None, examples: int, seed: int, out: Path, work: Path) -> Row:
    """Fuzz one mutant (``None``: the unmodified release) and classify the result."""
    name = m.name if m else "control"
    row = Row(name, m.why if m else "the unmodified release",
              list(m.args if m else CONTROL_ARGS), m.outcome if m else "survives",
              sorted(m.expect) if m else [])
    tree = mutant_tree(m, work / name)
    dest = out / name
    shutil.rmtree(dest, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "kvcheck"), "fuzz", "--target", f"vllm@{tree}",
           *row.args, "--examples", str(examples), "--seed", str(seed), "--quiet",
           "--no-failed-loads", "--no-report", "--out", str(dest)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800,
                       env=dict(os.environ, KVCHECK_NO_VENV="1"))
    row.seconds = round(time.monotonic() - t0, 1)
    lines = (p.stdout + p.stderr).splitlines()
    if p.returncode == 0:
        row.outcome, row.message = "survived", "all properties hold"
    elif p.returncode == 1 and (v := _VERDICT.search(p.stdout)):
        row.outcome = "killed"
        row.prop, row.prop_name, row.events = int(v.group(1)), v.group(2), int(v.group(3))
        said = [ln.strip(" >") for ln in lines if ln.lstrip(" >").startswith("VIOLATION property")]
        row.message = said[0] if said else v.group(0)
    elif p.returncode == 1 and any(ln.startswith("verdict: VACUOUS") for ln in lines):
        row.outcome = "vacuous"
        row.message = next(ln for ln in lines if ln.startswith("verdict: VACUOUS"))
    elif p.returncode == 3:
        row.outcome = "crashed"
        row.message = _crash_line(lines)
    else:
        row.outcome, row.message = "error", " ".join(" ".join(lines).split())[-300:]
    saved = sorted(dest.glob("*.json")) if dest.is_dir() else []
    if saved:  # one trace per row, named after the mutant
        saved[0].rename(dest / f"{name}.json")
        row.trace = str(dest / f"{name}.json")
    return row


def _crash_line(lines: list[str]) -> str:
    """The exception and where vLLM raised it, from the trace the CLI printed."""
    frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith('File "')]
    error = next((ln.strip() for ln in reversed(lines)
                  if re.match(r"\s*\w+(Error|Exception)\b", ln)), "the target crashed")
    if not frames:
        return error
    i = frames[-1]
    where = re.search(r'File "([^"]+)", line (\d+)', lines[i])
    code = lines[i + 1].strip() if i + 1 < len(lines) else ""
    if where is None:
        return error
    return f"{error} at {Path(where.group(1)).name}:{where.group(2)}: {code}"


def render(rows: list[Row], examples: int, seed: int) -> str:
    good = sum(r.ok for r in rows)
    lines = [
        f"# Mutants of vLLM {RELEASE}",
        "",
        f"{good}/{len(rows)} rows as expected ({examples} examples per row, seed {seed}, "
        f"failed loads off). A row is one edit to vLLM's own code, fuzzed as "
        f"`--target vllm@TREE`; `control` is the unmodified release. Rebuild a tree to "
        f"replay a trace: `scripts/mutants.py --tree NAME DIR`.",
        "",
        "| mutant | the slip | fuzzed with | wanted | outcome | property | events | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prop = f"{r.prop} ({r.prop_name})" if r.prop else "-"
        lines.append(f"| {r.name} | {r.why} | `{' '.join(r.args)}` | {r.wanted} | "
                     f"{r.outcome}{'' if r.ok else ' **UNEXPECTED**'} | {prop} | "
                     f"{r.events if r.events is not None else '-'} | {r.seconds} |")
    lines += ["", "## What the checker said", ""]
    lines += [f"- **{r.name}**: {r.message}" for r in rows if r.message]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names (and/or control)")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reports", default=str(ROOT / "reports"))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--tree", nargs=2, metavar=("NAME", "DIR"),
                    help="only build the mutant's vLLM tree in DIR (for --target vllm@DIR)")
    a = ap.parse_args(argv)
    byname = {m.name: m for m in MUTANTS}
    if a.tree:
        name, where = a.tree
        if name not in byname and name != "control":
            print(f"mutants: unknown mutant {name!r} (see --list)", file=sys.stderr)
            return 2
        if Path(where, "vllm").exists():
            print(f"mutants: {where}/vllm exists; choose an empty folder", file=sys.stderr)
            return 2
        try:
            print(mutant_tree(byname.get(name), Path(where)))
        except AnchorError as e:
            print(f"mutants: {e}", file=sys.stderr)
            return 2
        return 0
    if a.list:
        for m in MUTANTS:
            print(f"{m.name:28} {m.outcome:9} {m.why}")
        return 0
    names = {n for n in a.only.split(",") if n}
    known = set(byname) | {"control"}
    if names - known:
        print(f"mutants: unknown mutant(s) {', '.join(sorted(names - known))} "
              f"(see --list)", file=sys.stderr)
        return 2
    chosen: list[Mutant | None] = [None] if not names or "control" in names else []
    chosen += [m for m in MUTANTS if not names or m.name in names]
    reports = Path(a.reports)
    out = reports / "mutants"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcheck-mutants-") as tmp:
        for m in chosen:
            try:
                row = run_one(m, a.examples, a.seed, out, Path(tmp))
            except AnchorError as e:
                print(f"mutants: {e}", file=sys.stderr)
                return 2
            rows.append(row)
            print(f"{row.name:28} {row.outcome:9} {'ok ' if row.ok else 'BAD'} "
                  f"{row.seconds:6.1f}s  {row.message[:100]}", flush=True)
    (reports / "mutants.md").write_text(render(rows, a.examples, a.seed))
    (reports / "mutants.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"report: {reports / 'mutants.md'}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
