"""Property 6 on the ``sglang@0.5.23`` target: at depth 1 (SGLang's normal
loop) every event is judged by the settled freeing rule over SGLang's own
steps (properties/twin.py, ``SettledRule``), on SGLang's count (``sglang``:
the settled count less one token, ``seqlen - 1 - W``).

The unmodified release is silent and compared, with its radix tree disabled
and enabled (``SGLangRadixRule``: a page-rounded window over the slots the
tree does not own); a one-line slip in SGLang's
own ``ScheduleBatch.maybe_evict_swa`` that changes only the normal loop's
decode eviction (one token later when ``enable_overlap`` is off; safe, so
properties 1-5 and 7 accept it) is caught as property 6, and with the tree
a checkpoint's free one page later (``UnifiedRadixCache.checkpoint_into_tree``).
SGLang runs in a subprocess of its own (its import puts ``.sglang/0.5.23``
first on ``sys.path``): ``python -m tests.test_twin_sglang none|slip|radix-slip
PROPS EXAMPLES SEED on|off`` prints the verdict as JSON. A missing install fails, it never skips.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

from impl.sglang import compat

VERSION = "0.5.23"
# the slips, as scripts/mutants.py writes one: (module, class, function, old text, new text)
SLIPS = {
    # the normal loop's decode eviction one token later
    "slip": ("managers.schedule_batch", "ScheduleBatch", "maybe_evict_swa", "req.seqlen - 1,",
             "req.seqlen - 1 - (not self.enable_overlap),"),
    # with the radix tree, a checkpoint's out-of-window free one page later (the
    # normal loop's decode slip frees nothing the fuzzer reaches there: outputs
    # of at most 2B tokens never slide a page-rounded window past the prompt)
    "radix-slip": ("mem_cache.unified_radix_cache", "UnifiedRadixCache", "checkpoint_into_tree",
                   "comp.free_out_of_window_slots(req, len(radix_key) - 1, insert_params)",
                   "comp.free_out_of_window_slots(req, len(radix_key) - 1 - self.page_size, "
                   "insert_params)"),
}


def _run(slip: str, props: str, examples: int, seed: int, radix: bool = False) -> dict:
    d = compat.install_dir(VERSION)
    assert (d / "sglang" / "__init__.py").is_file(), (
        f"sglang {VERSION} is not installed in {d}: run {compat.install_command(VERSION)}")
    p = subprocess.run([sys.executable, "-m", "tests.test_twin_sglang", slip,
                        props, str(examples), str(seed), "on" if radix else "off"],
                       cwd=compat.REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1", SGLANG_SWA_EVICTION_INTERVAL="1"),
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_unmodified_sglang_at_depth_one_is_silent_and_compared():
    res = _run("none", "6", 60, 1)
    assert res["crash"] is None and res["violation"] is None, res
    assert res["expected"] == ["twin_rule"] and not res["vacuous"], res
    assert res["witness"]["window_free"] > 0 and res["witness"]["twin_rule"] > 0, res


def test_a_sync_only_slip_in_sglang_is_caught_by_property_6():
    res = _run("slip", "6", 100, 1)
    assert res["violation"] is not None and res["violation"]["prop"] == 6, res
    assert "the settled rule lets go of" in res["violation"]["message"], res
    # safe: properties 1-5 and 7 accept it, and the run reached window frees
    safe = _run("slip", "1,2,3,4,5,7", 60, 1)
    assert safe["violation"] is None and not safe["vacuous"], safe
    assert safe["witness"]["window_free"] > 0, safe


def test_the_radix_tree_at_depth_one_is_judged_and_a_slip_there_is_caught():
    """With the radix tree (``--prefix-caching on``) SGLang keeps a page-rounded
    window and what the tree owns (``SGLangRadixRule``): the release is
    silent and judged; a checkpoint that frees one page later is property 6,
    and properties 1-5 and 7 accept it."""
    res = _run("none", "6", 60, 1, radix=True)
    assert res["crash"] is None and res["violation"] is None, res
    assert res["expected"] == ["twin_rule"] and not res["vacuous"], res
    assert res["witness"]["window_free"] > 0 and res["witness"]["twin_rule"] > 0, res
    bad = _run("radix-slip", "6", 100, 1, radix=True)
    assert bad["violation"] is not None and bad["violation"]["prop"] == 6, bad
    assert "SGLang's radix rule" in bad["violation"]["message"], bad
    safe = _run("radix-slip", "1,2,3,4,5,7", 60, 1, radix=True)
    assert safe["violation"] is None and not safe["vacuous"], safe


def test_the_radix_rule_judges_own_slots_below_the_page_rounded_window():
    """``SGLangRadixRule`` over observations alone (W = 3, B = 2): the
    checkpoint of an 8-token prompt (``pre = 7``) frees own slots below
    ``(7 - ceil_align(3, 2)) // 2 = 1``; the first decode finds slot 0 gone
    (else late), and a free past the settled window is early."""
    from model.events import AddRequest, Process, Schedule, config_for
    from model.observations import (
        AllocObs,
        Counters,
        FreeObs,
        Observed,
        ProcessObs,
        ReqCounters,
        ReqStep,
        StepObs,
    )
    from properties.invariants import Checker
    from properties.twin import SGLangRadixRule

    cfg = config_for("sliding", window=3, block_size=2, num_blocks=40, depth=1,
                     max_model_len=32)

    def run(freed: list[int]):
        rule, checker = SGLangRadixRule(cfg, "sglang"), Checker(cfg)
        evs = [(AddRequest("a", 8, 4), Observed([])),
               (Schedule(), Observed([*(AllocObs(i + 1, 0, "a", i) for i in range(4)),
                                      StepObs(0, (ReqStep("a", 0, 8),))],
                                     Counters(35, 40, {"a": ReqCounters(8, None, (4,))}))),
               (Process(), Observed([ProcessObs(0),
                                     *(FreeObs(i + 1, 0, "a", i, "window") for i in freed)])),
               (Schedule(), Observed([AllocObs(5, 0, "a", 4),
                                      StepObs(1, (ReqStep("a", 8, 9),))]))]
        return [rule.check(ev, o, checker, k) for k, (ev, o) in enumerate(evs)]

    assert run([0]) == [None] * 4
    late = run([])[-1]
    assert late is not None and late.prop == 6 and "SGLang's radix rule" in late.message, late
    # slot 2 (positions 4-5) is below settled's window of the next token 8,
    # [6, 8]: freeing it sooner than SGLang does is safe; slot 3 is read
    assert run([0, 1, 2]) == [None] * 4
    early = run([0, 1, 2, 3])[2]
    assert early is not None and early.prop == 6 and "logical block 3" in early.message, early


def _apply_slip(slip: str) -> None:
    """Recompile the slip's function from its source with the slip."""
    import importlib

    module, cls, name, old, new = SLIPS[slip]
    mod = importlib.import_module(f"sglang.srt.{module}")
    src = textwrap.dedent(inspect.getsource(getattr(getattr(mod, cls), name)))
    assert src.count(old) == 1, f"the slip's anchor occurs {src.count(old)} times in {name}"
    ns: dict = {}
    exec(compile(src.replace(old, new), mod.__file__, "exec"), vars(mod), ns)  # noqa: S102
    setattr(getattr(mod, cls), name, ns[name])


def _main(slip: str, props: str, examples: int, seed: int, radix: bool) -> None:
    from impl.target import fit_spec, make_target
    from model.events import config_for
    from properties.machine import FuzzSpec, fuzz

    t = make_target(f"sglang@{VERSION}")
    t.reset(config_for("sliding", window=4, block_size=4, num_blocks=40, depth=1,
                       max_model_len=32))  # imports SGLang
    if slip != "none":
        _apply_slip(slip)
    spec = FuzzSpec(target=t.name, kind="sliding", depth=1, prefix_caching=radix,
                    props=frozenset(int(p) for p in props.split(",")))
    fit_spec(t.name, t.capabilities, spec)
    res = fuzz(spec, examples=examples, seed=seed, target=t)
    v = res.violation
    print(json.dumps({
        "crash": res.crash, "vacuous": res.vacuous,
        "violation": None if v is None else {"prop": v.prop, "message": v.message},
        "expected": sorted(k for k in res.stats.expected if k.startswith("twin")),
        "witness": dict(res.stats.witness)}))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "on")
