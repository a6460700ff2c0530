"""Property 6 on the ``sglang@0.5.23`` target: at depth 1 (SGLang's normal
loop) every event is judged by the settled freeing rule over SGLang's own
steps (properties/twin.py, ``SettledRule``), on SGLang's count (``sglang``:
the settled count less one token, ``seqlen - 1 - W``).

The unmodified release (radix tree disabled: with it SGLang keeps a
page-rounded window the rule does not mirror, and no twin runs) is silent
and compared; a one-line slip in SGLang's
own ``ScheduleBatch.maybe_evict_swa`` that changes only the normal loop's
decode eviction (one token later when ``enable_overlap`` is off; safe, so
properties 1-5 and 7 accept it) is caught as property 6. SGLang runs in a
subprocess of its own (its import puts ``.sglang/0.5.23`` first on
``sys.path``): ``python -m tests.test_twin_sglang [slip] PROPS`` prints the
verdict as JSON. A missing install fails, it never skips.
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
# the slip, as scripts/mutants.py writes one: (function, old text, new text)
SLIP = ("maybe_evict_swa", "req.seqlen - 1,",
        "req.seqlen - 1 - (not self.enable_overlap),")


def _run(slip: bool, props: str, examples: int, seed: int) -> dict:
    d = compat.install_dir(VERSION)
    assert (d / "sglang" / "__init__.py").is_file(), (
        f"sglang {VERSION} is not installed in {d}: run {compat.install_command(VERSION)}")
    p = subprocess.run([sys.executable, "-m", "tests.test_twin_sglang", "slip" if slip else "none",
                        props, str(examples), str(seed)], cwd=compat.REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1", SGLANG_SWA_EVICTION_INTERVAL="1"),
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def test_unmodified_sglang_at_depth_one_is_silent_and_compared():
    res = _run(False, "6", 60, 1)
    assert res["crash"] is None and res["violation"] is None, res
    assert res["expected"] == ["twin_rule"] and not res["vacuous"], res
    assert res["witness"]["window_free"] > 0 and res["witness"]["twin_rule"] > 0, res


def test_a_sync_only_slip_in_sglang_is_caught_by_property_6():
    res = _run(True, "6", 100, 1)
    assert res["violation"] is not None and res["violation"]["prop"] == 6, res
    assert "the settled rule lets go of" in res["violation"]["message"], res
    # safe: properties 1-5 and 7 accept it, and the run reached window frees
    safe = _run(True, "1,2,3,4,5,7", 60, 1)
    assert safe["violation"] is None and not safe["vacuous"], safe
    assert safe["witness"]["window_free"] > 0, safe


def _apply_slip() -> None:
    """Recompile ``ScheduleBatch.maybe_evict_swa`` from its source with the slip."""
    from sglang.srt.managers import schedule_batch as sb

    name, old, new = SLIP
    src = textwrap.dedent(inspect.getsource(getattr(sb.ScheduleBatch, name)))
    assert src.count(old) == 1, f"the slip's anchor occurs {src.count(old)} times in {name}"
    ns: dict = {}
    exec(compile(src.replace(old, new), sb.__file__, "exec"), vars(sb), ns)  # noqa: S102
    setattr(sb.ScheduleBatch, name, ns[name])


def _main(slip: str, props: str, examples: int, seed: int) -> None:
    from impl.target import fit_spec, make_target
    from model.events import config_for
    from properties.machine import FuzzSpec, fuzz

    t = make_target(f"sglang@{VERSION}")
    t.reset(config_for("sliding", window=4, block_size=4, num_blocks=40, depth=1,
                       max_model_len=32))  # imports SGLang
    if slip == "slip":
        _apply_slip()
    spec = FuzzSpec(target=t.name, kind="sliding", depth=1, prefix_caching=False,
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
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
